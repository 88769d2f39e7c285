//go:build tools

// Package tools names the containerd programs this module builds, so that `go mod tidy` keeps
// what they need; nothing here is compiled into anything.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
