"""A real Kubernetes control plane for the tests: etcd, kube-apiserver and kube-controller-manager
built from their Go modules (`tools/build.sh`), with localcluster's node agent running the Pods.

Next to `demo/localcluster/` (our own API server), it is the second cluster every end-to-end suite runs
on: what holds on one must hold on the other. Imported by tests, the bench and the CLI's
`realcluster` command, never by the product's packages.
"""
