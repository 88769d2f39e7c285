"""`python -m localcluster serve ...`"""

from localcluster.cli import localcluster

localcluster()
