//go:build tools

// Package tools names the Kubernetes programs this module builds, so that `go mod tidy` keeps
// what they need; nothing here is compiled into anything.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
