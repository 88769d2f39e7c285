"""`python -m realcluster serve ...`"""

from realcluster.cli import realcluster

realcluster()
