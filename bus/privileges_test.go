package bus_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/internal/testing/testlog"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// roles is an owner role that runs the migration and a service role that
// gets exactly store.Grants, in a schema the owner owns. Both roles and
// the schema are dropped when the test ends.
type roles struct {
	schema         string
	owner, service *sql.DB
	serviceURL     string
	serviceRole    string
}

// roleURL is the server of base (a URL) logged in as role with password.
func roleURL(t *testing.T, base, role, password string) string {
	t.Helper()
	u, err := url.Parse(base)
	require.NoError(t, err)
	u.User = url.UserPassword(role, password)
	q := u.Query()
	q.Del("user")
	q.Del("password")
	u.RawQuery = q.Encode()
	return u.String()
}

func openAs(t *testing.T, dbURL string) *sql.DB {
	t.Helper()
	db, err := bus.OpenDB(bus.DatabaseConfig{URL: dbURL})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	require.NoError(t, db.Ping())
	return db
}

// newRoles sets the roles up; with revoke >= 0 the service role lacks
// grant number revoke of store.Grants.
func newRoles(t *testing.T, cfg bus.Config, revoke int) roles {
	t.Helper()
	ctx := context.Background()
	admin := testdb.Open(t)
	base := testdb.UniqueName(t.Name())
	r := roles{schema: base, serviceRole: base + "_svc"}
	owner := base + "_own"
	password := testdb.UniqueName("pw")
	for _, role := range []string{owner, r.serviceRole} {
		_, err := admin.Exec(fmt.Sprintf(`CREATE ROLE %q LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD '%s'`, role, password))
		require.NoError(t, err, "creating roles needs a PostgreSQL user with CREATEROLE")
	}
	_, err := admin.Exec(fmt.Sprintf(`CREATE SCHEMA %q AUTHORIZATION %q`, r.schema, owner))
	require.NoError(t, err)
	t.Cleanup(func() {
		for _, stmt := range []string{
			fmt.Sprintf(`DROP SCHEMA IF EXISTS %q CASCADE`, r.schema),
			fmt.Sprintf(`DROP OWNED BY %q, %q`, r.serviceRole, owner),
			fmt.Sprintf(`DROP ROLE IF EXISTS %q`, r.serviceRole),
			fmt.Sprintf(`DROP ROLE IF EXISTS %q`, owner),
		} {
			// Sessions of the roles end when their pools close (cleanups
			// registered later run first).
			if _, err := admin.Exec(stmt); err != nil {
				t.Errorf("cleanup %s: %v", stmt, err)
			}
		}
	})

	r.owner = openAs(t, roleURL(t, testdb.URL(), owner, password))
	cfg.Database.Schema = r.schema
	require.NoError(t, bus.Migrate(ctx, r.owner, cfg), "the owner role runs the migration")
	grants, err := store.GrantSQL(tablesOf(cfg), r.serviceRole)
	require.NoError(t, err)
	_, err = r.owner.Exec(grants)
	require.NoError(t, err, "the owner grants the service role its privileges")
	if revoke >= 0 {
		g := store.Grants(tablesOf(cfg))[revoke]
		_, err = r.owner.Exec(fmt.Sprintf(`REVOKE %s ON %s %s FROM %q`, g.Privilege, g.Kind, g.Object, r.serviceRole))
		require.NoError(t, err)
	}
	r.serviceURL = roleURL(t, testdb.URL(), r.serviceRole, password)
	r.service = openAs(t, r.serviceURL)
	return r
}

func tablesOf(cfg bus.Config) store.Tables {
	cfg = cfg.WithDefaults()
	return store.Tables{Schema: cfg.Database.Schema, OutboxTopic: cfg.Outbox.Topic}
}

// evidence collects everything a run said: log lines and returned errors.
type evidence struct {
	testlog.Buffer
	mu   sync.Mutex
	errs []string
}

func (e *evidence) add(err error) {
	if err != nil {
		e.mu.Lock()
		e.errs = append(e.errs, err.Error())
		e.mu.Unlock()
	}
}

func (e *evidence) text() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.Buffer.String() + strings.Join(e.errs, "\n")
}

// serviceRun is a service running as the service role: it publishes two
// good events and a bad one, schedules two and cancels one, relays them,
// runs a saga on them (with a corrupt outbox row to
// quarantine and forwarded rows to clean up), handles them with the inbox,
// the ordering guard and inbox retention on, and poisons the bad one.
type serviceRun struct {
	r       roles
	cfg     bus.Config
	ev      *evidence
	mu      sync.Mutex
	handled map[string]bool
	stop    func() error
}

func startService(t *testing.T, revoke int) *serviceRun {
	t.Helper()
	ctx := context.Background()
	cfg := privilegeConfig(t)
	s := &serviceRun{r: newRoles(t, cfg, revoke), ev: &evidence{}, handled: map[string]bool{}}
	cfg.Database.Schema = s.r.schema
	s.cfg = cfg
	topic := strings.ReplaceAll(s.r.schema, "_", "-")
	brokertest.Cleanup(t, bus.KindNATS, topic, "billing")

	// A row no broker can take: its payload is not a millrace envelope.
	_, err := s.r.owner.Exec(`INSERT INTO ` + tablesOf(cfg).OutboxTable() + ` (uuid, payload, metadata, transaction_id)
		VALUES ('corrupt-1', '{"not":"an envelope"}', '{}', pg_current_xact_id())`)
	require.NoError(t, err)

	b, err := bus.Open(ctx, cfg, s.r.service, bus.WithLogger(s.ev.Slog()))
	s.ev.add(err)
	if err != nil {
		s.stop = func() error { return nil }
		return s
	}
	t.Cleanup(func() { b.Close() })
	s.handle(t, b, topic)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- b.Run(runCtx) }()
	var once sync.Once
	var runErr error
	s.stop = func() error {
		once.Do(func() { cancel(); runErr = <-done })
		return runErr
	}
	t.Cleanup(func() { _ = s.stop() })
	s.ev.add(b.PublishInOwnTx(ctx, topic,
		bus.Event{Type: "OrderPlaced", AggregateType: "order", AggregateID: "o-1", AggregateVersion: 1, Payload: []byte(`{}`)},
		bus.Event{Type: "OrderPlaced", AggregateType: "order", AggregateID: "o-2", AggregateVersion: 1, Payload: []byte(`{}`)},
		bus.Event{Type: "Bad", AggregateType: "order", AggregateID: "o-3", AggregateVersion: 1, Payload: []byte(`{}`)},
		bus.Event{Type: "OrderPlaced", AggregateType: "order", AggregateID: "o-3", AggregateVersion: 2, Payload: []byte(`{}`)},
	))
	released := make(chan struct{})
	go func() { defer close(released); s.releaseParks(runCtx) }()
	t.Cleanup(func() { _ = s.stop(); <-released }) // stop ends runCtx
	s.ev.add(s.schedule(ctx, b, topic))
	return s
}

// privilegeConfig is the config of startService's service: a relay that
// deletes at once, an inbox and a saga that prune at once, an ordered
// handler that parks.
func privilegeConfig(t *testing.T) bus.Config {
	var cfg bus.Config
	brokertest.Apply(t, bus.KindNATS, &cfg)
	cfg.Relay.PollInterval = 50 * time.Millisecond
	cfg.Relay.CleanupInterval = 50 * time.Millisecond
	cfg.Relay.Retention = new(time.Duration(0))
	cfg.Consumer.Workers = 1
	cfg.Consumer.OrderingGuard = new(true)
	cfg.Consumer.Retry.MaxAttempts = 1
	cfg.Consumer.Inbox.Retention = time.Millisecond
	cfg.Consumer.Inbox.CleanupInterval = 50 * time.Millisecond
	// The saga's step fails twice for o-2 before it succeeds: its error is
	// recorded, then replaced.
	cfg.Consumer.Handlers = map[string]middleware.Config{"fulfilment": {Retry: middleware.RetryConfig{
		MaxAttempts: 3, InitialInterval: 10 * time.Millisecond, MaxInterval: 10 * time.Millisecond, Mode: middleware.RetryInProcess}},
		// Ordered: the bad event parks o-3, whose next event waits behind
		// it until the operator skips it (releaseParks).
		"billing": {Ordered: new(true)}}
	return cfg
}

// handle registers the service's handlers: billing (ordered; it refuses
// the Bad event) and the fulfilment saga.
func (s *serviceRun) handle(t *testing.T, b *bus.Bus, topic string) {
	require.NoError(t, b.Handle(topic, "billing", func(ctx context.Context, ev bus.Event) error {
		if ev.Type == "Bad" {
			return bus.Permanent(errors.New("refused on purpose"))
		}
		s.mu.Lock()
		s.handled[ev.AggregateID] = true
		s.mu.Unlock()
		return nil
	}))
	// A saga each OrderPlaced starts and completes, deleted at once by its
	// retention, with its step errors.
	placed := bus.Must(bus.NewTopic[privilegeOrderPlaced](topic))
	saga := bus.NewSaga("fulfilment", bus.WithSagaRetention[struct{ Seen bool }](0))
	var failures atomic.Int32
	bus.StartWith(saga, placed, func(m bus.Message[privilegeOrderPlaced]) string { return m.AggregateID },
		func(ctx context.Context, sc *bus.SagaContext[struct{ Seen bool }], m bus.Message[privilegeOrderPlaced]) error {
			if sc.ID == "o-2" && failures.Add(1) <= 2 {
				return errors.New("fails twice on purpose")
			}
			sc.State.Seen = true
			sc.Complete()
			return nil
		})
	require.NoError(t, saga.Handle(b, "fulfilment"))
}

// releaseParks is the operator (the owner role): it skips the poisoned
// message of each parked aggregate, so that the service drains the park.
func (s *serviceRun) releaseParks(ctx context.Context) {
	oc, err := ops.New(ctx, s.r.owner, s.cfg)
	if err != nil {
		s.ev.add(err)
		return
	}
	for ctx.Err() == nil {
		parks, err := oc.Parked(ctx, ops.ParkedFilter{State: ops.ParkStateHeld}, 0)
		for _, p := range parks.Rows {
			_, err = oc.DLQ().Skip(ctx, ops.Selection{IDs: []int64{p.PoisonID}}, false)
		}
		if err != nil && ctx.Err() == nil {
			s.ev.add(fmt.Errorf("the operator's skip: %w", err))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

type privilegeOrderPlaced struct{}

func (privilegeOrderPlaced) EventType() string { return "OrderPlaced" }

// schedule schedules one event due at once, which the relay moves into the
// outbox, and one due in an hour, which it cancels.
func (s *serviceRun) schedule(ctx context.Context, b *bus.Bus, topic string) error {
	tx, err := s.r.service.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	if _, err := b.Schedule(ctx, tx, topic, bus.DueIn(0),
		bus.Event{Type: "OrderPlaced", AggregateType: "order", AggregateID: "o-4", AggregateVersion: 1, Payload: []byte(`{}`)}); err != nil {
		return err
	}
	later, err := b.Schedule(ctx, tx, topic, bus.DueIn(time.Hour),
		bus.Event{Type: "OrderPlaced", AggregateType: "order", AggregateID: "o-5", AggregateVersion: 1, Payload: []byte(`{}`)})
	if err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return err
	}
	tx, err = s.r.service.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	if err := b.CancelScheduled(ctx, tx, later[0]); err != nil {
		return err
	}
	return tx.Commit()
}

func (s *serviceRun) count(t *testing.T, table string) int {
	t.Helper()
	var n int
	require.NoError(t, s.r.owner.QueryRow(`SELECT count(*) FROM "`+s.r.schema+`".`+table).Scan(&n))
	return n
}

func (s *serviceRun) inspect() (ops.OutboxStatus, error) {
	oc, err := ops.New(context.Background(), s.r.service, s.cfg)
	if err != nil {
		return ops.OutboxStatus{}, err
	}
	if _, err := oc.ListScheduled(context.Background(), 10); err != nil {
		return ops.OutboxStatus{}, err
	}
	return oc.OutboxStatus(context.Background(), "")
}

// The service role with exactly the listed privileges runs everything:
// publish, schedule and cancel, relay (with quarantine, cleanup and the
// move of due scheduled events), a consumer with the inbox,
// the ordering guard, inbox retention and the poison table, and outbox
// status; and it can do nothing else.
func TestLeastPrivilegeRoleRunsEverything(t *testing.T) {
	t.Parallel()
	s := startService(t, -1)
	require.Empty(t, s.ev.errs, "bus.Open and Publish as the service role")
	require.Eventually(t, func() bool {
		s.mu.Lock()
		handled := len(s.handled)
		s.mu.Unlock()
		return handled == 4 && // o-3's second event too, once its aggregate was released
			s.count(t, "millrace_parks") == 0 && s.count(t, "millrace_parked") == 0 &&
			s.count(t, "millrace_scheduled") == 0 && // one moved into the outbox when due, one cancelled
			s.count(t, "millrace_sagas") == 0 && // sagas started, completed and deleted
			s.count(t, "millrace_saga_errors") == 0 && // o-2's step error, recorded twice, deleted by retention
			s.count(t, "millrace_poison") == 1 &&
			s.count(t, "millrace_relay_quarantine") == 1 &&
			// billing and fulfilment: o-1, o-2, o-3 (version 2), o-4 (o-3's
			// bad event is not of fulfilment's type: acked before the inbox)
			s.count(t, "millrace_aggregate_versions") == 8 &&
			s.count(t, "watermill_millrace_outbox") == 0 && // forwarded rows cleaned up
			s.count(t, "millrace_inbox") == 0 // processed events pruned by retention
	}, 90*time.Second, 20*time.Millisecond, "the service did not finish its work; it said:\n%s", s.ev.text())
	st, err := s.inspect()
	require.NoError(t, err, "outbox status as the service role")
	require.Zero(t, st.Pending)
	require.Equal(t, int64(1), st.Quarantined)
	require.NoError(t, s.stop())
	require.NotContains(t, s.ev.text(), "permission denied")

	// What was not granted is refused.
	_, err = s.r.owner.Exec(`CREATE TABLE "` + s.r.schema + `".orders (id text)`)
	require.NoError(t, err)
	outbox := tablesOf(s.cfg).OutboxTable()
	for stmt, want := range map[string]string{
		`SELECT * FROM "` + s.r.schema + `".orders`:                  "permission denied for table orders",
		`UPDATE ` + outbox + ` SET payload = '{}'`:                   "permission denied for table watermill_millrace_outbox",
		`TRUNCATE ` + outbox:                                         "permission denied for table watermill_millrace_outbox",
		`DROP TABLE ` + outbox:                                       "must be owner of table watermill_millrace_outbox",
		`DELETE FROM "` + s.r.schema + `".millrace_poison`:           "permission denied for table millrace_poison",
		`DELETE FROM "` + s.r.schema + `".millrace_relay_quarantine`: "permission denied for table millrace_relay_quarantine",
		`CREATE TABLE "` + s.r.schema + `".sneaky (id int)`:          "permission denied for schema " + s.r.schema,
		`ALTER TABLE "` + s.r.schema + `".millrace_inbox ADD x int`:  "must be owner of table millrace_inbox",
		`CREATE SCHEMA "` + s.r.schema + `_2"`:                       "permission denied for database",
	} {
		_, err := s.r.service.Exec(stmt)
		require.ErrorContains(t, err, want, stmt)
	}
}

// Every listed privilege is needed: with any single one revoked, the run
// above fails with PostgreSQL's "permission denied" for that object. So the
// list in docs/SECURITY.md is not broader than what millrace uses.
func TestEveryListedPrivilegeIsNeeded(t *testing.T) {
	t.Parallel()
	template := store.Tables{Schema: "schema", OutboxTopic: bus.Config{}.WithDefaults().Outbox.Topic}
	for i, g := range store.Grants(template) {
		if g.Sharding {
			continue // the service runs one shard; TestShardingGrantsAreNeeded covers these
		}
		t.Run(g.Privilege+" "+g.Kind+" "+g.Name, func(t *testing.T) {
			t.Parallel()
			s := startService(t, i)
			name := g.Name
			if g.Kind == "SCHEMA" {
				name = s.r.schema
			}
			want := "permission denied for " + strings.ToLower(g.Kind) + " " + name
			deadline := time.Now().Add(90 * time.Second)
			for !strings.Contains(s.ev.text(), want) {
				require.True(t, time.Now().Before(deadline), "without %s on %s %s the service never hit %q; it said:\n%s",
					g.Privilege, g.Kind, g.Name, want, s.ev.text())
				_, err := s.inspect() // outbox status is part of what the role does
				s.ev.add(err)
				time.Sleep(50 * time.Millisecond)
			}
		})
	}
}

// The statements in docs/SECURITY.md's Database privileges section are the
// ones millrace generates (and the tests above run) for the default schema
// and topic.
func TestDocsListTheGeneratedGrants(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../docs/SECURITY.md")
	require.NoError(t, err)
	_, privileges, ok := strings.Cut(string(doc), "\n## Database privileges\n")
	require.True(t, ok, "docs/SECURITY.md has a Database privileges section")
	_, block, ok := strings.Cut(privileges, "```sql\n")
	require.True(t, ok, "the Database privileges section has an sql block")
	block, _, _ = strings.Cut(block, "```")
	want, err := bus.GrantSQL(bus.Config{}, "orders_app")
	require.NoError(t, err)
	require.Equal(t, want, block, "regenerate with: millrace grants --role orders_app")
}

// A relay with relay.shards: 2 runs as the service role with the listed
// privileges (it records the count on a fresh outbox, registers, heartbeats
// and takes the shards), and fails with "permission denied" for the object
// of each sharding privilege revoked.
func TestShardingGrantsAreNeeded(t *testing.T) {
	t.Parallel()
	template := store.Tables{Schema: "schema", OutboxTopic: bus.Config{}.WithDefaults().Outbox.Topic}
	for i, g := range store.Grants(template) {
		if !g.Sharding {
			continue
		}
		t.Run(g.Privilege+" "+g.Kind+" "+g.Name, func(t *testing.T) {
			t.Parallel()
			f, ev := startShardedRelay(t, i)
			want := "permission denied for table " + g.Name
			testkit.Eventually(t, 90*time.Second, want, func() bool { return strings.Contains(ev.String(), want) })
			require.NotEqual(t, forwarder.RoleActive, f.Status().Role)
		})
	}
	t.Run("all granted", func(t *testing.T) {
		t.Parallel()
		f, ev := startShardedRelay(t, -1)
		testkit.Eventually(t, 90*time.Second, "the relay to own its shards", func() bool { return f.Status().Role == forwarder.RoleActive })
		require.NotContains(t, ev.String(), "permission denied")
	})
}

// startShardedRelay runs a relay on two shards as the service role, without
// grant number revoke, until the test ends.
func startShardedRelay(t *testing.T, revoke int) (*forwarder.Forwarder, *testlog.Buffer) {
	t.Helper()
	var cfg bus.Config
	brokertest.Apply(t, bus.KindNATS, &cfg)
	r := newRoles(t, cfg, revoke)
	cfg.Database.Schema = r.schema
	cfg = cfg.WithDefaults()
	broker, err := bus.OpenBroker(context.Background(), cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { broker.Close() })
	ev := &testlog.Buffer{}
	shards := 2
	f, err := forwarder.New(r.service, broker, forwarder.Outbox{Schema: r.schema, Topic: cfg.Outbox.Topic},
		forwarder.Config{Shards: &shards, PollInterval: 50 * time.Millisecond, RetryInitial: 20 * time.Millisecond, RetryMax: 200 * time.Millisecond},
		forwarder.Options{Logger: ev.Watermill()})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return f, ev
}
