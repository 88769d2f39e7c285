//go:build tools

// Package tools names the helm program this module builds, so that `go mod tidy` keeps what it
// needs; nothing here is compiled into anything.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
