"""`python -m k8s_dispatch.demo.localcluster serve ...`"""

from k8s_dispatch.demo.localcluster.cli import localcluster

localcluster()
