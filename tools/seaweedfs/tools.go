//go:build tools

// Package tools names the SeaweedFS program this module builds (weed: its master, volume, filer
// and S3 gateway in one binary, the tests' S3-compatible object store), so that `go mod tidy`
// keeps what it needs; nothing here is compiled into anything.
package tools

import _ "github.com/seaweedfs/seaweedfs/weed"
