"""`python -m realcluster serve ...`"""

from k8s_dispatch.lab.realcluster.cli import realcluster

realcluster()
