//go:build tools

// Package tools names the program this module builds (promtool, which checks and unit-tests the
// alerting rules in deploy/monitoring/), so that `go mod tidy` keeps what it needs; nothing here
// is compiled into anything.
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
