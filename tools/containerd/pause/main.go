// Command pause is the Pod sandbox's process: it holds the Pod's namespaces and does nothing else
// until it is told to stop. It does what Kubernetes' own pause does: SIGINT or SIGTERM ends it
// with status 0, and as PID 1 of a shared PID namespace it reaps every orphan that ends under it.
// Static (CGO_ENABLED=0) so the image needs no libc; the image is assembled by realcluster/images.py.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-v" {
		os.Stdout.WriteString("pause (k8s-dispatch)\n")
		return
	}
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
