"""`python -m realcluster serve ...`"""

from k8s_dispatch.realcluster.cli import realcluster

realcluster()
