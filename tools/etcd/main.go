// Command etcd is the etcd server, built from go.etcd.io/etcd/server/v3 for the test control
// plane: the module publishes etcdmain but no installable main package of its own.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
