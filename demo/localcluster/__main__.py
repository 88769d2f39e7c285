"""`python -m localcluster serve ...`"""

from k8s_dispatch.demo.localcluster.cli import localcluster

localcluster()
