package devcluster

import (
	"errors"
	"net"

	"github.com/millrace-io/millrace/adapters/internal/adapterkit"
)

// AcquireFunc starts or joins the process's dev cluster on addrs with at
// least brokers brokers and returns its broker addresses (port 0 replaced
// by the port picked) and the function that releases it.
type AcquireFunc func(addrs []string, brokers int) (listening []string, release func(), err error)

// Starter is the AcquireFunc that package kafkadev registers.
var Starter adapterkit.Link[AcquireFunc]

// ErrNotLinked is returned by Acquire when no package registered a starter.
var ErrNotLinked = errors.New("the in-process Kafka dev cluster is not linked into this program")

// Acquire calls the registered AcquireFunc, or returns ErrNotLinked.
func Acquire(addrs []string, brokers int) (listening []string, release func(), err error) {
	acquire, ok := Starter.Func()
	if !ok {
		return nil, nil, ErrNotLinked
	}
	return acquire(addrs, brokers)
}

// IsLoopback reports whether host is 127.0.0.1 or localhost, the only
// addresses the dev cluster listens on.
func IsLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.Equal(net.IPv4(127, 0, 0, 1))
}
