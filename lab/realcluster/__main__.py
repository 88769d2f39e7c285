"""`python -m k8s_dispatch.lab.realcluster serve ...`"""

from k8s_dispatch.lab.realcluster.cli import realcluster

realcluster()
