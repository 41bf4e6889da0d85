// Command demo runs millrace's seed scenario end to end and prints the
// counts that prove its guarantees (run it with `make demo`):
//
//  1. 100 orders are committed, each with its OrderCreated event in the
//     same transaction;
//  2. a relay publishes the first batch, the broker confirms it, and the
//     relay is killed with SIGKILL before it records (acks) the batch;
//  3. a second relay sends that batch again and drains the outbox;
//  4. the billing consumer, with the inbox on, bills every order once.
//
// The broker is config.yaml's broker.kind (MILLRACE_BROKER_KIND overrides
// it). NATS runs in-process (embedded JetStream) and Kafka as an in-process
// dev cluster unless NATS_URL / KAFKA_BROKERS name real servers; RabbitMQ
// is the local server (`make up`), and the demo falls back to NATS when
// none answers.
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace-io/millrace/adapters"
	"github.com/millrace-io/millrace/adapters/kafka/kafkadev"
	"github.com/millrace-io/millrace/adapters/nats/natsdev"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/examples/billing"
	"github.com/millrace-io/millrace/examples/orders"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// Demo settings.
const (
	// defaultSchema holds the demo's tables; it is dropped and recreated.
	defaultSchema = "millrace_demo"
	firstBatch    = 20         // rows relay #1 publishes before it is killed
	tapGroup      = "demo-tap" // a consumer group that only counts what the broker holds
	// childEnvKey set in the environment makes the demo binary run relay #1.
	childEnvKey = "MILLRACE_DEMO_CRASHING_RELAY"
	// configEnvKey and schemaEnvKey pass the config file's path and the
	// demo schema to relay #1.
	configEnvKey = "MILLRACE_DEMO_CONFIG"
	schemaEnvKey = "MILLRACE_DEMO_SCHEMA"
)

// quiet keeps the demo's output to its own progress lines: only warnings
// and errors of millrace and Watermill are logged.
var quiet = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

// Counts are what the demo prints at the end.
type Counts struct {
	Broker            string
	Topic             string // the run's own topic, deprovisioned when run returns
	Orders            int
	OutboxPending     int64
	PublishedByRelays int // confirmed by the broker, counting the batch sent twice
	// SentTwice is relay #1's batch: confirmed by the broker, not acked, sent
	// again by relay #2. At most firstBatch; fewer when, at relay #1's read,
	// a transaction of another session still open held back what the relay
	// may read (the outbox's commit-order visibility).
	SentTwice         int
	OnBroker          int // messages the broker kept, counted by a fresh consumer group
	DeliveredBilling  int // deliveries to the billing consumer group
	InboxRows         int
	BillingRows       int
	DuplicatesSkipped int
}

func main() {
	if os.Getenv(childEnvKey) != "" {
		os.Exit(runCrashingRelay())
	}
	configPath := flag.String("config", "config.yaml", "path to config.yaml")
	count := flag.Int("orders", 100, "orders to commit")
	schema := flag.String("schema", defaultSchema, "PostgreSQL schema for the demo's tables (dropped and recreated)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if _, err := run(ctx, *configPath, *schema, *count, os.Stdout); err != nil {
		log.Fatal(err)
	}
}

// run plays the scenario with the config at configPath, in schema, and
// prints progress and the final counts to out.
func run(ctx context.Context, configPath, schema string, count int, out io.Writer) (Counts, error) {
	cfg, err := bus.LoadConfig(configPath)
	if err != nil {
		return Counts{}, err
	}
	cfg.Database.Schema = schema
	if err := cfg.Validate(); err != nil { // the schema goes into DROP SCHEMA below
		return Counts{}, err
	}
	stopBroker, label, err := brokerFor(ctx, &cfg, out)
	if err != nil {
		return Counts{}, err
	}
	defer stopBroker()
	fmt.Fprintf(out, "millrace demo on %s; database %s, schema %s\n", label, redact(cfg.Database.URL), cfg.Database.Schema)

	db, err := bus.OpenDB(cfg.Database)
	if err != nil {
		return Counts{}, err
	}
	defer db.Close()
	if _, err := db.ExecContext(ctx, `DROP SCHEMA IF EXISTS "`+cfg.Database.Schema+`" CASCADE`); err != nil {
		return Counts{}, fmt.Errorf("database %s: %w", redact(cfg.Database.URL), err)
	}
	if err := bus.Migrate(ctx, db, cfg); err != nil {
		return Counts{}, err
	}
	if err := orders.Setup(ctx, db, cfg.Database.Schema); err != nil {
		return Counts{}, err
	}
	if err := billing.Setup(ctx, db, cfg.Database.Schema); err != nil {
		return Counts{}, err
	}
	broker, err := bus.OpenBroker(ctx, cfg, nil)
	if err != nil {
		return Counts{}, err
	}
	defer broker.Close()
	// Topic suffixed per run so that a real broker's earlier runs do not count.
	topic := orders.Topic + "." + uuid.NewString()[:8]
	if err := broker.Provision(ctx, topic, billing.HandlerName, tapGroup); err != nil {
		return Counts{}, err
	}
	// The per-run topic's streams, queues and exchanges go when the demo ends.
	defer func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if err := broker.Deprovision(ctx, topic, billing.HandlerName, tapGroup); err != nil {
			fmt.Fprintf(out, "cleanup: %v\n", err)
		}
	}()
	fmt.Fprintf(out, "[1/5] schema %s migrated; topic %s with consumer groups %s and %s\n", cfg.Database.Schema, topic, billing.HandlerName, tapGroup)

	// 1. Orders and their events, one transaction each.
	b, err := bus.Open(ctx, cfg, db, bus.WithLogger(quiet))
	if err != nil {
		return Counts{}, err
	}
	defer b.Close()
	svc := orders.New(b, db, cfg.Database.Schema)
	svc.Topic = topic
	for i := range count {
		if err := svc.Create(ctx, orders.OrderCreated{OrderID: fmt.Sprintf("ord-%03d", i+1), Customer: "c-42", TotalCents: int64(1000 + i)}, nil); err != nil {
			return Counts{}, err
		}
	}
	fmt.Fprintf(out, "[2/5] %d orders committed, each with its OrderCreated event in the same transaction\n", count)

	// 2. Relay #1 dies between the broker's confirm and its ack.
	confirmed, err := crashRelay(ctx, configPath, cfg, out)
	if err != nil {
		return Counts{}, err
	}

	// 3. Relay #2 finishes the job.
	outbox := forwarder.Outbox{Schema: cfg.Database.Schema, Topic: cfg.Outbox.Topic}
	relay, err := forwarder.New(db, broker, outbox, cfg.Relay, forwarder.Options{})
	if err != nil {
		return Counts{}, err
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(relayCtx) }()
	oc, err := ops.New(ctx, db, cfg)
	if err != nil {
		stopRelay()
		<-relayDone
		return Counts{}, err
	}
	st, err := waitPending(ctx, oc, out)
	stopRelay()
	if rerr := <-relayDone; err == nil {
		err = rerr
	}
	if err != nil {
		return Counts{}, err
	}
	fmt.Fprintf(out, "[4/5] relay #2 sent the unacked batch again and drained the outbox: %d pending\n", st.Pending)

	// 4. The billing consumer with the inbox, and a tap group counting what the broker holds.
	c, err := consume(ctx, cfg, db, broker, topic, count, out)
	if err != nil {
		return Counts{}, err
	}
	c.Broker, c.Topic, c.OutboxPending = cfg.Broker.Kind, topic, st.Pending
	c.PublishedByRelays, c.SentTwice = count+confirmed, confirmed
	if c.Orders, err = orders.Count(ctx, db, cfg.Database.Schema); err != nil {
		return Counts{}, err
	}
	if c.BillingRows, err = billing.Count(ctx, db, cfg.Database.Schema); err != nil {
		return Counts{}, err
	}
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM "`+cfg.Database.Schema+`".millrace_inbox WHERE consumer_group = $1`,
		billing.HandlerName).Scan(&c.InboxRows); err != nil {
		return Counts{}, err
	}
	printCounts(out, c)
	return c, nil
}

// crashRelay runs relay #1 in a child process and returns how many events
// the broker confirmed before the relay was killed.
func crashRelay(ctx context.Context, configPath string, cfg bus.Config, out io.Writer) (int, error) {
	cmd := exec.CommandContext(ctx, os.Args[0])
	cmd.Env = append(os.Environ(), childEnv(configPath, cfg)...)
	cmd.Stderr = os.Stderr
	var stdout strings.Builder
	cmd.Stdout = &stdout
	err := cmd.Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		return 0, fmt.Errorf("relay #1 should have died by SIGKILL, got %v: %s", err, stdout.String())
	}
	var confirmed int
	if _, err := fmt.Sscanf(stdout.String(), "confirmed %d", &confirmed); err != nil {
		return 0, fmt.Errorf("relay #1 said %q: %w", stdout.String(), err)
	}
	fmt.Fprintf(out, "[3/5] relay #1 published its first batch of %d, the broker confirmed it, and the relay was killed (SIGKILL) before acking\n", confirmed)
	return confirmed, nil
}

// runCrashingRelay is relay #1: it publishes one batch and kills itself
// once the broker has confirmed it, before the relay can ack it.
func runCrashingRelay() int {
	ctx := context.Background()
	cfg, err := bus.LoadConfig(os.Getenv(configEnvKey))
	if err != nil {
		log.Print(err)
		return 1
	}
	cfg.Database.Schema = os.Getenv(schemaEnvKey)
	db, err := bus.OpenDB(cfg.Database)
	if err != nil {
		log.Print(err)
		return 1
	}
	broker, err := bus.OpenBroker(ctx, cfg, nil)
	if err != nil {
		log.Print(err)
		return 1
	}
	relayCfg := cfg.Relay
	relayCfg.BatchSize, relayCfg.MaxInFlight = firstBatch, firstBatch
	f, err := forwarder.New(db, killAfterConfirm{Broker: broker}, forwarder.Outbox{Schema: cfg.Database.Schema, Topic: cfg.Outbox.Topic}, relayCfg, forwarder.Options{})
	if err != nil {
		log.Print(err)
		return 1
	}
	if err := f.Run(ctx); err != nil {
		log.Print(err)
	}
	return 1 // not reached: the first confirmed batch kills the process
}

// killAfterConfirm is a broker whose first confirmed batch ends the process.
type killAfterConfirm struct{ adapters.Broker }

func (k killAfterConfirm) PublishBatch(ctx context.Context, msgs []adapters.Outgoing) error {
	err := k.Broker.PublishBatch(ctx, msgs)
	if err == nil {
		fmt.Printf("confirmed %d\n", len(msgs))
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	return err
}

func waitPending(ctx context.Context, oc *ops.Client, out io.Writer) (ops.OutboxStatus, error) {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		st, err := oc.OutboxStatus(ctx, "")
		if err != nil || st.Pending == 0 {
			return st, err
		}
		if time.Now().After(deadline) {
			return st, fmt.Errorf("the outbox still has %d pending events after 2 minutes", st.Pending)
		}
		fmt.Fprintf(out, "      relay #2: %d pending\n", st.Pending)
		time.Sleep(100 * time.Millisecond)
	}
}

// consume runs the billing handler (inbox on, relay off) and a tap group
// until every order is billed and both groups have seen everything the
// broker holds.
func consume(ctx context.Context, cfg bus.Config, db *sql.DB, broker adapters.Broker, topic string, count int, out io.Writer) (Counts, error) {
	cfg.Relay.Enabled = new(false)
	reg := prometheus.NewRegistry()
	b, err := bus.Open(ctx, cfg, db, bus.WithRegistry(reg), bus.WithLogger(quiet))
	if err != nil {
		return Counts{}, err
	}
	defer b.Close()
	if err := b.Handle(topic, billing.HandlerName, billing.Handler(cfg.Database.Schema)); err != nil {
		return Counts{}, err
	}
	var tapped atomic.Int64
	stopTap, err := tap(ctx, broker, topic, &tapped)
	if err != nil {
		return Counts{}, err
	}
	defer stopTap()
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- b.Run(runCtx) }()

	var c Counts
	deadline := time.Now().Add(2 * time.Minute)
	last, stableSince := -1, time.Now()
	for {
		billed, err := billing.Count(ctx, db, cfg.Database.Schema)
		if err != nil {
			stop()
			return c, err
		}
		ok, dup := outcomes(reg)
		c.DeliveredBilling, c.DuplicatesSkipped, c.OnBroker = ok+dup, dup, int(tapped.Load())
		if c.DeliveredBilling != last {
			last, stableSince = c.DeliveredBilling, time.Now()
			fmt.Fprintf(out, "      billing: %d of %d orders billed, %d deliveries, %d duplicates skipped\n", billed, count, c.DeliveredBilling, dup)
		}
		// Done when every order is billed and both groups have taken
		// everything the broker holds (no delivery for a second).
		if billed == count && c.DeliveredBilling >= c.OnBroker && time.Since(stableSince) > time.Second {
			break
		}
		if time.Now().After(deadline) {
			stop()
			return c, fmt.Errorf("billing did not finish within 2 minutes: %d of %d billed", billed, count)
		}
		time.Sleep(100 * time.Millisecond)
	}
	stop()
	if err := <-done; err != nil {
		return c, err
	}
	fmt.Fprintf(out, "[5/5] billing consumer done\n")
	return c, nil
}

// tap counts every message of topic for its own consumer group: what the
// broker holds.
func tap(ctx context.Context, broker adapters.Broker, topic string, n *atomic.Int64) (stop func(), err error) {
	sub, err := broker.Subscriber(adapters.SubscriberSpec{Group: tapGroup})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		cancel()
		_ = sub.Close()
		return nil, err
	}
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		defer sub.Close()
		for {
			select {
			case <-ctx.Done():
				return
			case m, ok := <-msgs:
				if !ok {
					return
				}
				n.Add(1)
				m.Ack()
			}
		}
	}()
	// The group's member has left once stop returns, so the topology can go.
	return func() { cancel(); <-closed }, nil
}

// outcomes reads the billing handler's ok and duplicate counts.
func outcomes(reg *prometheus.Registry) (ok, dup int) {
	families, _ := reg.Gather()
	for _, mf := range families {
		if mf.GetName() != middleware.MetricMessages {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() != "outcome" {
					continue
				}
				switch l.GetValue() {
				case middleware.OutcomeOK:
					ok += int(m.GetCounter().GetValue())
				case middleware.OutcomeDuplicate:
					dup += int(m.GetCounter().GetValue())
				}
			}
		}
	}
	return ok, dup
}

func printCounts(out io.Writer, c Counts) {
	fmt.Fprintln(out)
	fmt.Fprintf(out, "  orders committed              %5d\n", c.Orders)
	fmt.Fprintf(out, "  outbox pending                %5d\n", c.OutboxPending)
	fmt.Fprintf(out, "  published by the relays       %5d   (%d twice: confirmed by the broker, not acked by relay #1)\n", c.PublishedByRelays, c.SentTwice)
	note := "the duplicates from the crash are on the broker"
	if c.Broker == bus.KindNATS {
		note = "NATS dropped the re-sent events itself: same event id (Nats-Msg-Id) within its duplicate window"
	}
	fmt.Fprintf(out, "  messages on the broker        %5d   (%s)\n", c.OnBroker, note)
	fmt.Fprintf(out, "  delivered to billing          %5d\n", c.DeliveredBilling)
	fmt.Fprintf(out, "  inbox rows                    %5d\n", c.InboxRows)
	fmt.Fprintf(out, "  billing rows                  %5d\n", c.BillingRows)
	fmt.Fprintf(out, "  duplicates skipped (inbox)    %5d   = delivered - billed\n", c.DuplicatesSkipped)
	fmt.Fprintln(out)
	if c.Orders == c.BillingRows && c.InboxRows == c.Orders && c.OutboxPending == 0 {
		fmt.Fprintln(out, "Every committed order reached the broker and was billed exactly once.")
	} else {
		fmt.Fprintln(out, "MISMATCH: the counts above do not add up.")
	}
}

// brokerFor starts the in-process broker the config asks for, or falls
// back to NATS when RabbitMQ is selected but no server answers.
func brokerFor(ctx context.Context, cfg *bus.Config, out io.Writer) (stop func(), label string, err error) {
	switch cfg.Broker.Kind {
	case bus.KindRabbitMQ:
		if reachable(cfg.Broker.RabbitMQ.URL) {
			return func() {}, "RabbitMQ " + redact(cfg.Broker.RabbitMQ.URL) + " (quorum queues)", nil
		}
		fmt.Fprintf(out, "RabbitMQ does not answer at %s (run `make up`); falling back to NATS\n", redact(cfg.Broker.RabbitMQ.URL))
		cfg.Broker.Kind = bus.KindNATS
		return brokerFor(ctx, cfg, out)
	case bus.KindKafka:
		if os.Getenv("KAFKA_BROKERS") != "" {
			return func() {}, "Kafka " + strings.Join(cfg.Broker.Kafka.Brokers, ","), nil
		}
		dev, err := kafkadev.Start(kafkadev.Options{})
		if err != nil {
			return nil, "", err
		}
		cfg.Broker.Kafka.Brokers, cfg.Broker.Kafka.DevCluster = dev.Addrs(), false
		return dev.Close, "Kafka dev cluster (in-process kfake, not for production) at " + strings.Join(dev.Addrs(), ","), nil
	default:
		if os.Getenv("NATS_URL") != "" {
			cfg.Broker.NATS.Embedded.Enabled = false
			return func() {}, "NATS JetStream " + redact(cfg.Broker.NATS.URL), nil
		}
		dir, err := os.MkdirTemp("", "millrace-demo-nats-")
		if err != nil {
			return nil, "", err
		}
		srv, err := natsdev.Start("nats://127.0.0.1:0", natsdev.Options{StoreDir: dir})
		if err != nil {
			return nil, "", err
		}
		cfg.Broker.NATS.URL, cfg.Broker.NATS.Embedded.Enabled = srv.URL(), false
		return func() { srv.Shutdown(); _ = os.RemoveAll(dir) }, "NATS JetStream (in-process, embedded) at " + srv.URL(), nil
	}
}

// childEnv passes the config file, and the broker and database the parent
// chose, to relay #1.
func childEnv(configPath string, cfg bus.Config) []string {
	return []string{
		childEnvKey + "=1", configEnvKey + "=" + configPath, schemaEnvKey + "=" + cfg.Database.Schema,
		"MILLRACE_BROKER_KIND=" + cfg.Broker.Kind,
		"NATS_URL=" + cfg.Broker.NATS.URL, "NATS_EMBEDDED=false",
		"KAFKA_BROKERS=" + strings.Join(cfg.Broker.Kafka.Brokers, ","), "KAFKA_DEV_CLUSTER=false",
		"AMQP_URL=" + cfg.Broker.RabbitMQ.URL,
		"DATABASE_URL=" + cfg.Database.URL,
	}
}

func reachable(rawURL string) bool {
	u, err := url.Parse(rawURL)
	if err != nil {
		return false
	}
	conn, err := net.DialTimeout("tcp", u.Host, 2*time.Second)
	if err != nil {
		return false
	}
	_ = conn.Close()
	return true
}

func redact(raw string) string {
	if u, err := url.Parse(raw); err == nil {
		return u.Redacted()
	}
	return "<url>"
}
