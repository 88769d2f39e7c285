//go:build tools

// Package tools names the Kueue controller this module builds (tests/realcluster/test_kueue.py
// runs it against the real control plane), so that `go mod tidy` keeps what it needs; nothing
// here is compiled into anything.
package tools

import _ "sigs.k8s.io/kueue/cmd/kueue"
