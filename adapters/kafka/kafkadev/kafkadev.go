package kafkadev

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/millrace-io/millrace/adapters/kafka/internal/devcluster"
)

func init() { devcluster.Starter.Register(acquireDevCluster) }

// Options configure Start.
type Options struct {
	// Addrs are the 127.0.0.1 host:port addresses the first brokers listen
	// on; port 0 picks a free port. Defaults to one broker on a free port.
	Addrs []string
	// Brokers is the number of brokers; those beyond Addrs listen on free
	// ports. It bounds the replication factor topics can have. Defaults to
	// max(len(Addrs), 3).
	Brokers int
	// DataDir, when set, keeps the cluster's data (topics, records,
	// committed offsets, producer ids) in this directory, so a cluster
	// started again on the same Addrs and DataDir has it all back. Defaults
	// to memory only.
	DataDir string
	// MaxMessageBytes is the brokers' message.max.bytes. Defaults to
	// 1048588, Kafka's default.
	MaxMessageBytes int
}

// Cluster is an in-process Kafka-protocol cluster for demos and tests
// (github.com/twmb/franz-go/pkg/kfake). It is not Kafka: it does not
// replicate (acks=all is answered at once), keeps data in memory unless
// DataDir is set, and listens on 127.0.0.1 only. It expires the sessions of
// consumer group members that died mid-join, which kfake alone does not.
// Never use it in production.
type Cluster struct {
	cluster *kfake.Cluster
	expirer *sessionExpirer
	addrs   []string
	once    sync.Once
}

// Start starts an in-process Kafka-protocol cluster for demos and tests.
// Close stops it.
func Start(opts Options) (*Cluster, error) {
	var ports []int
	for _, a := range opts.Addrs {
		host, portText, err := net.SplitHostPort(a)
		if err != nil {
			return nil, fmt.Errorf("kafka dev cluster: address %q is not host:port", a)
		}
		if !devcluster.IsLoopback(host) {
			return nil, fmt.Errorf("kafka dev cluster: address %q: the dev cluster listens on 127.0.0.1 only", a)
		}
		port, err := strconv.Atoi(portText)
		if err != nil || port < 0 || port > 65535 {
			return nil, fmt.Errorf("kafka dev cluster: address %q has no valid port", a)
		}
		ports = append(ports, port)
	}
	n := opts.Brokers
	if n == 0 {
		n = max(len(ports), 3)
	}
	if n < len(ports) {
		return nil, fmt.Errorf("kafka dev cluster: %d brokers cannot listen on %d addresses", n, len(ports))
	}
	for len(ports) < n {
		ports = append(ports, 0)
	}
	kopts := []kfake.Opt{kfake.Ports(ports...), kfake.ClusterID("millrace-dev")}
	if opts.DataDir != "" {
		kopts = append(kopts, kfake.DataDir(opts.DataDir))
	}
	if opts.MaxMessageBytes > 0 {
		kopts = append(kopts, kfake.BrokerConfigs(map[string]string{
			"message.max.bytes": strconv.Itoa(opts.MaxMessageBytes),
		}))
	}
	c, err := kfake.NewCluster(kopts...)
	if err != nil {
		return nil, fmt.Errorf("kafka dev cluster: cannot start on %s: %w (another dev cluster or a Kafka broker may be listening there)",
			strings.Join(opts.Addrs, ","), err)
	}
	expirer, err := startSessionExpirer(c, c.ListenAddrs(), time.Second)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("kafka dev cluster: %w", err)
	}
	return &Cluster{cluster: c, expirer: expirer, addrs: c.ListenAddrs()}, nil
}

// Addrs returns the host:port of every broker, the bootstrap list for
// broker.kafka.brokers. Starting a new cluster on these addresses with the
// same DataDir brings the same cluster back.
func (d *Cluster) Addrs() []string { return slices.Clone(d.addrs) }

// Close stops the cluster and drops every client connection. It is idempotent.
func (d *Cluster) Close() {
	d.once.Do(func() {
		d.expirer.close()
		d.cluster.Close()
	})
}

// devClusters are the dev clusters kafka.Open started in this process, by address
// list, so that several Brokers opened on one dev_cluster config share it.
var devClusters = struct {
	sync.Mutex
	m map[string]*sharedDevCluster
}{m: map[string]*sharedDevCluster{}}

type sharedDevCluster struct {
	dc   *Cluster
	refs int
}

// acquireDevCluster starts or joins the process's dev cluster on addrs and
// returns its broker addresses (port 0 replaced by the port picked) and the
// function that releases it; the last release stops it.
func acquireDevCluster(addrs []string, brokers int) (listening []string, release func(), err error) {
	key := strings.Join(addrs, ",")
	devClusters.Lock()
	defer devClusters.Unlock()
	s := devClusters.m[key]
	if s == nil {
		dc, err := Start(Options{Addrs: addrs, Brokers: max(brokers, len(addrs))})
		if err != nil {
			return nil, nil, errors.Join(err, errors.New("set broker.kafka.dev_cluster: false to use the broker already there"))
		}
		s = &sharedDevCluster{dc: dc}
		devClusters.m[key] = s
	}
	s.refs++
	var once sync.Once
	return s.dc.Addrs(), func() {
		once.Do(func() {
			devClusters.Lock()
			defer devClusters.Unlock()
			s.refs--
			if s.refs == 0 {
				s.dc.Close()
				delete(devClusters.m, key)
			}
		})
	}, nil
}
