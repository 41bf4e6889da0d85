package brokertest

import (
	"context"
	"database/sql"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/testdb"
)

// Service is what an end-to-end test of a service starts from: a schema
// of the test's own, migrated, and the bus.Config that names it and a
// broker kind.
type Service struct {
	DB     *sql.DB
	Config bus.Config
}

// NewService opens the test database, gives the config a schema of the
// test's own and the broker section of kind, lets each configure change
// it, and migrates the schema.
func NewService(t testing.TB, kind string, configure ...func(*bus.Config)) *Service {
	t.Helper()
	s := &Service{DB: testdb.Open(t)}
	s.Config.Database.Schema = testdb.Schema(t, s.DB)
	Apply(t, kind, &s.Config)
	for _, f := range configure {
		f(&s.Config)
	}
	if err := bus.Migrate(context.Background(), s.DB, s.Config); err != nil {
		t.Fatalf("migrate %s: %v", s.Config.Database.Schema, err)
	}
	return s
}

// Table is the table name of the service's schema, quoted for SQL.
func (s *Service) Table(name string) string {
	return `"` + s.Config.Database.Schema + `".` + name
}

// Open opens a Bus on the service's database and config, closed when the
// test ends.
func (s *Service) Open(t testing.TB, opts ...bus.Option) *bus.Bus {
	t.Helper()
	b, err := bus.Open(context.Background(), s.Config, s.DB, opts...)
	if err != nil {
		t.Fatalf("open the bus: %v", err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// Subscribe subscribes group to topic on broker until the test ends.
func Subscribe(t testing.TB, broker adapters.Broker, topic, group string) <-chan *message.Message {
	t.Helper()
	sub, err := broker.Subscriber(adapters.SubscriberSpec{Group: group})
	if err != nil {
		t.Fatalf("subscriber of %s: %v", group, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); _ = sub.Close() })
	ch, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatalf("subscribe %s to %s: %v", group, topic, err)
	}
	return ch
}

// Tap opens cfg's broker, provisions group on topic and subscribes it,
// until the test ends: what reaches the broker reaches the channel.
func Tap(t testing.TB, cfg bus.Config, topic, group string) <-chan *message.Message {
	t.Helper()
	ctx := context.Background()
	broker, err := bus.OpenBroker(ctx, cfg, nil)
	if err != nil {
		t.Fatalf("open the broker: %v", err)
	}
	t.Cleanup(func() { _ = broker.Close() })
	if err := broker.Provision(ctx, topic, group); err != nil {
		t.Fatalf("provision %s on %s: %v", group, topic, err)
	}
	return Subscribe(t, broker, topic, group)
}
