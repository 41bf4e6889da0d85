package console_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/store"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/ops"
	"github.com/millrace-io/millrace/ops/console"
)

// fixture is a migrated schema with poisoned messages and quarantined
// rows, and the operations API over it.
type fixture struct {
	db   *sql.DB
	cfg  bus.Config
	ops  *ops.Client
	ids  []int64 // poison row ids
	qids []int64 // quarantine row ids
}

// newFixture stores n poisoned messages (reason "card 40<i> declined")
// and one quarantined row; cfg, when given, adds to the default config.
func newFixture(t *testing.T, n int, cfg bus.Config) *fixture {
	t.Helper()
	ctx := context.Background()
	db := testdb.Open(t)
	cfg.Database.Schema = testdb.Schema(t, db)
	require.NoError(t, bus.Migrate(ctx, db, cfg))
	oc, err := ops.New(ctx, db, cfg)
	require.NoError(t, err)
	f := &fixture{db: db, cfg: cfg, ops: oc}
	tables := store.Tables{Schema: cfg.Database.Schema, OutboxTopic: "millrace_outbox"}
	now := time.Now().UTC()
	for i := range n {
		require.NoError(t, tables.StorePoisoned(ctx, db, store.Poisoned{
			ConsumerGroup: "billing", Handler: "billing", SourceTopic: "orders.events",
			MessageID: fmt.Sprintf("m-%d", i), EventID: fmt.Sprintf("e-%d", i), EventType: "OrderPlaced",
			Payload: []byte(fmt.Sprintf(`{"order":%d}`, i)), Metadata: map[string]string{"event-id": fmt.Sprintf("e-%d", i), "aggregate-id": fmt.Sprintf("o-%d", i)},
			Reason: fmt.Sprintf("card 40%d declined", i), ErrorClass: "permanent", Attempts: 1,
			FirstFailureAt: now, LastFailureAt: now, PoisonedAt: now,
		}))
	}
	list, err := oc.DLQ().List(ctx, ops.Filter{}, 0)
	require.NoError(t, err)
	for _, m := range list.Rows {
		f.ids = append(f.ids, m.ID)
	}
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, tables.Quarantine(ctx, tx, store.OutboxRow{Offset: 7, UUID: "u-7", Payload: []byte("not an envelope"), Metadata: []byte("{}")},
		"", "", "unreadable envelope"))
	require.NoError(t, tx.Commit())
	q, err := oc.Quarantine().List(ctx, ops.Filter{}, 0)
	require.NoError(t, err)
	for _, r := range q.Rows {
		f.qids = append(f.qids, r.ID)
	}
	return f
}

// serve starts the console over f with opts, under prefix ("" for the root).
func (f *fixture) serve(t *testing.T, opts console.Options, prefix string) *httptest.Server {
	t.Helper()
	c, err := console.New(f.ops, opts)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	var h http.Handler = c
	if prefix != "" {
		mux := http.NewServeMux()
		mux.Handle(prefix+"/", http.StripPrefix(prefix, h))
		h = mux
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// client is a browser-like client: it keeps cookies and does not follow
// redirects.
type client struct {
	t    *testing.T
	base string
	http *http.Client
	auth func(*http.Request)
}

func newClient(t *testing.T, base string) *client {
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	return &client{t: t, base: base, http: &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	}}}
}

func (c *client) do(req *http.Request) (int, string) {
	c.t.Helper()
	if c.auth != nil {
		c.auth(req)
	}
	resp, err := c.http.Do(req)
	require.NoError(c.t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(c.t, err)
	return resp.StatusCode, string(body)
}

func (c *client) get(path string) (int, string) {
	c.t.Helper()
	req, err := http.NewRequest(http.MethodGet, c.base+path, nil)
	require.NoError(c.t, err)
	return c.do(req)
}

func (c *client) post(path string, form url.Values, header ...string) (int, string) {
	c.t.Helper()
	req, err := http.NewRequest(http.MethodPost, c.base+path, strings.NewReader(form.Encode()))
	require.NoError(c.t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	return c.do(req)
}

var csrfField = regexp.MustCompile(`name="csrf" value="([0-9a-f]{64})"`)
var expectField = regexp.MustCompile(`name="expect" value="([0-9a-f]{16})"`)

// csrf loads path and returns the CSRF token its forms carry.
func (c *client) csrf(path string) string {
	c.t.Helper()
	code, body := c.get(path)
	require.Equal(c.t, http.StatusOK, code, body)
	m := csrfField.FindStringSubmatch(body)
	require.NotNil(c.t, m, "the page has a form with a CSRF token")
	return m[1]
}

func (f *fixture) pages() []string {
	return []string{"/", "/dlq", "/dlq/groups", fmt.Sprintf("/dlq/%d", f.ids[0]), "/quarantine", fmt.Sprintf("/quarantine/%d", f.qids[0]),
		"/dlq?reason=declined&state=waiting", "/dlq/groups?handler=billing", "/sagas", "/sagas?state=all", "/scheduled", "/dlq/parked", "/dlq/parked?state=held"}
}

func (f *fixture) remaining(t *testing.T) int {
	list, err := f.ops.DLQ().List(context.Background(), ops.Filter{}, 0)
	require.NoError(t, err)
	return len(list.Rows)
}

// Every action needs its session's CSRF token, and a browser's
// cross-origin request is refused even with one.
func TestActionsNeedTheCSRFToken(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 2, bus.Config{})
	srv := f.serve(t, console.Options{}, "")
	c := newClient(t, srv.URL)
	token := c.csrf("/dlq")
	id := fmt.Sprint(f.ids[0])
	for name, form := range map[string]url.Values{
		"no token":    {"id": {id}},
		"wrong token": {"id": {id}, "csrf": {strings.Repeat("0", 64)}},
	} {
		for _, path := range []string{"/dlq/purge", "/dlq/replay", "/quarantine/purge", "/quarantine/replay", "/login"} {
			code, body := c.post(path, form)
			require.Equal(t, http.StatusForbidden, code, "%s %s", name, path)
			require.Contains(t, body, "CSRF token")
		}
	}
	code, _ := c.post("/dlq/purge", url.Values{"id": {id}, "csrf": {token}}, "Sec-Fetch-Site", "cross-site")
	require.Equal(t, http.StatusForbidden, code, "a cross-origin request")
	other := newClient(t, srv.URL)
	code, _ = other.post("/dlq/purge", url.Values{"id": {id}, "csrf": {token}})
	require.Equal(t, http.StatusForbidden, code, "another session's token")
	require.Equal(t, 2, f.remaining(t), "nothing was purged")

	code, body := c.post("/dlq/purge", url.Values{"id": {id}, "csrf": {token}})
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "1 would be purged")
	require.Equal(t, 2, f.remaining(t), "a dry run first")
	expect := expectField.FindStringSubmatch(body)
	require.NotNil(t, expect)
	code, body = c.post("/dlq/purge", url.Values{"id": {id}, "csrf": {token}, "expect": {expect[1]}})
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "1 purged")
	require.Equal(t, 1, f.remaining(t))
}

// With a token or basic authentication configured, no page answers
// without it, and what it shows never includes the token.
func TestAuthenticationGuardsEveryPage(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 2, bus.Config{})
	const secret = "tok-3f9a-very-secret"
	srv := f.serve(t, console.Options{Token: secret}, "")
	anon := newClient(t, srv.URL)
	for _, p := range f.pages() {
		code, body := anon.get(p)
		require.Equal(t, http.StatusUnauthorized, code, p)
		require.NotContains(t, body, "declined", "%s shows no data without the token", p)
		require.Contains(t, body, "Access token")
	}
	code, _ := anon.post("/dlq/purge", url.Values{"id": {fmt.Sprint(f.ids[0])}, "scope": {"filter"}})
	require.Equal(t, http.StatusUnauthorized, code)
	anon.auth = func(r *http.Request) { r.Header.Set("Authorization", "Bearer wrong") }
	code, _ = anon.get("/dlq")
	require.Equal(t, http.StatusUnauthorized, code)

	bearer := newClient(t, srv.URL)
	bearer.auth = func(r *http.Request) { r.Header.Set("Authorization", "Bearer "+secret) }
	for _, p := range f.pages() {
		code, body := bearer.get(p)
		require.Equal(t, http.StatusOK, code, p)
		require.NotContains(t, body, secret, p)
	}

	// The login form sets a cookie holding a MAC of the token, not the token.
	browser := newClient(t, srv.URL)
	token := browser.csrf("/login")
	code, _ = browser.post("/login", url.Values{"csrf": {token}, "token": {"wrong"}})
	require.Equal(t, http.StatusUnauthorized, code)
	code, _ = browser.post("/login", url.Values{"csrf": {token}, "token": {secret}})
	require.Equal(t, http.StatusSeeOther, code)
	u, _ := url.Parse(srv.URL)
	for _, ck := range browser.http.Jar.Cookies(u) {
		require.NotContains(t, ck.Value, secret)
	}
	code, body := browser.get("/dlq")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "declined")

	basic := f.serve(t, console.Options{BasicUser: "ops", BasicPassword: "pw-8c1e"}, "")
	anon = newClient(t, basic.URL)
	code, _ = anon.get("/")
	require.Equal(t, http.StatusUnauthorized, code)
	anon.auth = func(r *http.Request) { r.SetBasicAuth("ops", "nope") }
	code, _ = anon.get("/dlq")
	require.Equal(t, http.StatusUnauthorized, code)
	anon.auth = func(r *http.Request) { r.SetBasicAuth("ops", "pw-8c1e") }
	for _, p := range f.pages() {
		code, body := anon.get(p)
		require.Equal(t, http.StatusOK, code, p)
		require.NotContains(t, body, "pw-8c1e", p)
	}
	_, err := console.New(f.ops, console.Options{BasicUser: "ops"})
	require.Error(t, err, "a user without a password")
}

// Read-only mode shows no action and refuses every one.
func TestReadOnlyRefusesEveryAction(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 2, bus.Config{})
	srv := f.serve(t, console.Options{ReadOnly: true}, "")
	c := newClient(t, srv.URL)
	for _, p := range f.pages() {
		code, body := c.get(p)
		require.Equal(t, http.StatusOK, code, p)
		require.NotContains(t, body, "Purge", p)
		require.NotContains(t, body, "Skip…", p)
		require.NotContains(t, body, "Replay selected", p)
	}
	for _, form := range []url.Values{
		{"id": {fmt.Sprint(f.ids[0])}}, {"scope": {"filter"}, "state": {"waiting"}}, {"id": {fmt.Sprint(f.qids[0])}},
	} {
		for _, action := range []string{"/dlq/replay", "/dlq/purge", "/dlq/skip", "/quarantine/replay", "/quarantine/purge"} {
			code, body := c.post(action, form)
			require.Equal(t, http.StatusForbidden, code, action)
			require.Contains(t, body, "read-only")
		}
	}
	require.Equal(t, 2, f.remaining(t))
}

// No secret of the configuration is rendered on any page.
func TestNoSecretIsRendered(t *testing.T) {
	t.Parallel()
	var cfg bus.Config
	u, err := url.Parse(testdb.URL())
	require.NoError(t, err)
	u.User = url.UserPassword(u.User.Username(), "db-pw-71ab") // trust authentication ignores it
	cfg.Database.URL = u.String()
	cfg.Broker.NATS.URL = "nats://svc:nats-pw-19cd@127.0.0.1:4222"
	cfg.Broker.RabbitMQ.URL = "amqp://svc:amqp-pw-55ee@127.0.0.1:5672/"
	f := newFixture(t, 1, cfg)
	srv := f.serve(t, console.Options{}, "")
	c := newClient(t, srv.URL)
	for _, p := range f.pages() {
		code, body := c.get(p)
		require.Equal(t, http.StatusOK, code, p)
		for _, secret := range []string{"db-pw-71ab", "nats-pw-19cd", "amqp-pw-55ee"} {
			require.NotContains(t, body, secret, p)
		}
	}
}

// Unknown filters, malformed ids and times are a 400 naming what is wrong.
func TestBadInputIsA400WithTheReason(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1, bus.Config{})
	srv := f.serve(t, console.Options{}, "")
	c := newClient(t, srv.URL)
	for path, reason := range map[string]string{
		"/dlq?colour=red":                 `unknown filter "colour"`,
		"/dlq?since=yesterday":            `since "yesterday"`,
		"/dlq?until=2025-13-01":           `until "2025-13-01"`,
		"/dlq?limit=0":                    `limit "0"`,
		"/dlq?state=lost":                 `state "lost"`,
		"/dlq?fingerprint=zz":             `fingerprint "zz"`,
		"/dlq?topic=a&topic=b":            `filter "topic" is given 2 times`,
		"/dlq/groups?limit=5":             `unknown filter "limit"`,
		"/dlq/abc":                        `"abc" is not an id`,
		"/dlq/0":                          `"0" is not an id`,
		"/dlq/1?x=1":                      "this page takes no filters",
		"/quarantine?handler=billing":     `unknown filter "handler"`,
		"/quarantine/-3":                  `"-3" is not an id`,
		"/?page=2":                        "this page takes no filters",
		"/sagas?state=done":               `state "done"`,
		"/sagas?limit=1001":               `limit "1001"`,
		"/sagas?topic=orders":             `unknown filter "topic"`,
		"/sagas?saga=a&saga=b":            `filter "saga" is given 2 times`,
		"/sagas/order_fulfilment/o-1?x=1": "this page takes no filters",
		"/scheduled?limit=abc":            `limit "abc"`,
		"/scheduled?state=waiting":        `unknown filter "state"`,
		"/dlq/parked?state=stuck":         `state "stuck"`,
		"/dlq/parked?reason=x":            `unknown filter "reason"`,
		"/dlq/parked?limit=0":             `limit "0"`,
	} {
		code, body := c.get(path)
		require.Equal(t, http.StatusBadRequest, code, path)
		require.Contains(t, body, strings.ReplaceAll(reason, `"`, "&#34;"), path)
	}
	code, _ := c.get("/dlq/987654321")
	require.Equal(t, http.StatusNotFound, code)

	token := c.csrf("/dlq")
	for reason, form := range map[string]url.Values{
		`id &#34;abc&#34;`:                {"id": {"abc"}},
		"nothing selected":                {},
		"give ids or scope=filter":        {"id": {"1"}, "scope": {"filter"}, "state": {"waiting"}},
		"scope=filter needs":              {"scope": {"filter"}},
		`unknown filter &#34;colour&#34;`: {"scope": {"filter"}, "colour": {"red"}},
		`since &#34;soon&#34;`:            {"scope": {"filter"}, "since": {"soon"}},
		"filters apply with scope=filter": {"handler": {"billing"}},
		`expect &#34;x&#34;`:              {"id": {"1"}, "expect": {"x"}},
		`scope &#34;everything&#34;`:      {"scope": {"everything"}},
	} {
		form.Set("csrf", token)
		code, body := c.post("/dlq/replay", form)
		require.Equal(t, http.StatusBadRequest, code, reason)
		require.Contains(t, body, reason)
	}
	code, body := c.post("/quarantine/purge", url.Values{"csrf": {token}, "scope": {"filter"}, "fingerprint": {"0123456789ab"}})
	require.Equal(t, http.StatusBadRequest, code)
	require.Contains(t, body, "unknown filter &#34;fingerprint&#34;", "the quarantine has no failure groups")
	code, _ = c.post("/dlq/archive", url.Values{"csrf": {token}, "id": {"1"}})
	require.Equal(t, http.StatusNotFound, code)
	require.Equal(t, 1, f.remaining(t))
}

// An action confirmed after its rows changed (replayed or purged by
// someone else) reports it and does nothing.
func TestAChangedSelectionIsReported(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, 3, bus.Config{})
	srv := f.serve(t, console.Options{}, "/ops")
	c := newClient(t, srv.URL+"/ops")
	token := c.csrf("/dlq")
	_, body := c.get("/dlq/groups")
	require.Contains(t, body, `href="/ops/dlq?fingerprint=`, "links keep the mount prefix")

	group := url.Values{"csrf": {token}, "scope": {"filter"}, "reason": {"declined"}}
	code, body := c.post("/dlq/replay", group)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "3 selected would be replayed as 3 outbox message(s)")
	expect := expectField.FindStringSubmatch(body)[1]

	_, err := f.ops.DLQ().Replay(ctx, ops.Selection{IDs: f.ids[:1]}, ops.ReplayOptions{By: "cli"})
	require.NoError(t, err)
	group.Set("expect", expect)
	code, body = c.post("/dlq/replay", group)
	require.Equal(t, http.StatusConflict, code)
	require.Contains(t, body, "changed since they were reviewed")
	d, err := f.ops.DLQ().Get(ctx, f.ids[1])
	require.NoError(t, err)
	require.Empty(t, d.Replays, "nothing was replayed by the stale confirmation")

	one := url.Values{"csrf": {token}, "id": {fmt.Sprint(f.ids[2])}}
	_, body = c.post("/dlq/purge", one)
	one.Set("expect", expectField.FindStringSubmatch(body)[1])
	_, err = f.ops.DLQ().Purge(ctx, ops.Selection{IDs: f.ids[2:]}, false)
	require.NoError(t, err)
	code, body = c.post("/dlq/purge", one)
	require.Equal(t, http.StatusConflict, code)
	require.Contains(t, body, "purged meanwhile")
}

// A replay's dry run names the consumer groups that will process it; a
// replay the relay quarantined shows on the message's page as state
// quarantined, with a link to the quarantine's row and its reason.
func TestReplayGroupsAndAQuarantinedReplayAreShown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, 1, bus.Config{})
	srv := f.serve(t, console.Options{}, "")
	c := newClient(t, srv.URL)
	token := c.csrf("/dlq")
	code, body := c.post("/dlq/replay", url.Values{"csrf": {token}, "id": {fmt.Sprint(f.ids[0])}})
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "replay, processed only by consumer group(s) billing")

	res, err := f.ops.DLQ().Replay(ctx, ops.Selection{IDs: f.ids}, ops.ReplayOptions{})
	require.NoError(t, err)
	tables := store.Tables{Schema: f.cfg.Database.Schema, OutboxTopic: "millrace_outbox"}
	var row store.OutboxRow
	require.NoError(t, f.db.QueryRow(`SELECT "offset", uuid, payload FROM "`+f.cfg.Database.Schema+`".watermill_millrace_outbox`).Scan(&row.Offset, &row.UUID, &row.Payload))
	require.Equal(t, res.Replayed[0].MessageID, row.UUID)
	tx, err := f.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, tables.Quarantine(ctx, tx, row, "orders.events", "e-0", "nats: size: over the stream's max_msg_size"))
	require.NoError(t, tx.Commit())
	q, err := f.ops.Quarantine().List(ctx, ops.Filter{Reason: "max_msg_size"}, 0)
	require.NoError(t, err)
	require.Len(t, q.Rows, 1)

	_, body = c.get(fmt.Sprintf("/dlq/%d", f.ids[0]))
	require.Contains(t, body, `<dd class="state-quarantined">quarantined</dd>`)
	require.Contains(t, body, fmt.Sprintf(`as <a href="/quarantine/%d">row %d</a>: nats: size: over the stream&#39;s max_msg_size`, q.Rows[0].ID, q.Rows[0].ID))
	_, body = c.get("/dlq")
	require.Contains(t, body, `<td class="state-quarantined">quarantined</td>`)
}

// The order saga of the saga pages' tests: an order starts it with a
// payment timeout; the payment completes it.
type (
	orderPlaced    struct{ orderRef }
	paymentCharged struct{ orderRef }
	paymentLate    struct{ orderRef }
	orderState     struct {
		Step  string
		Items []string
	}
)

// orderRef is what each event of the order saga carries: its order, the
// aggregate.
type orderRef struct{ OrderID string }

func (e orderRef) Aggregate() (string, string) { return "order", e.OrderID }

func (orderPlaced) EventType() string    { return "OrderPlaced" }
func (paymentCharged) EventType() string { return "PaymentCharged" }
func (paymentLate) EventType() string    { return "PaymentTimedOut" }

// sagaFixture is f with the order saga's consumer chains over a bus on
// f's schema, driven by deliver.
type sagaFixture struct {
	*fixture
	chains map[string]message.NoPublishHandlerFunc
}

func newSagaFixture(t *testing.T) sagaFixture {
	t.Helper()
	ctx := context.Background()
	var cfg bus.Config
	brokertest.Apply(t, bus.KindNATS, &cfg)
	f := newFixture(t, 1, cfg)
	b, err := bus.Open(ctx, f.cfg, f.db)
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	orders := bus.Must(bus.NewTopic[orderPlaced]("orders.events"))
	payments := bus.Must(bus.NewTopic[paymentCharged]("payments.events"))
	timeouts := bus.Must(bus.NewTopic[paymentLate]("orders.saga-timeouts"))
	saga := bus.NewSaga[orderState]("order_fulfilment")
	bus.StartWith(saga, orders, func(m bus.Message[orderPlaced]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[orderState], m bus.Message[orderPlaced]) error {
			sc.State.Step, sc.State.Items = "charging", []string{"sku-1", "sku-2"}
			late, err := timeouts.Event(paymentLate{orderRef{sc.ID}})
			if err != nil {
				return err
			}
			return sc.ScheduleTimeout(ctx, "payment", timeouts.Name(), bus.DueIn(time.Hour), late)
		})
	bus.Then(saga, payments, func(m bus.Message[paymentCharged]) string { return m.Value.OrderID },
		func(ctx context.Context, sc *bus.SagaContext[orderState], m bus.Message[paymentCharged]) error {
			if sc.ID == "o-declined" {
				return bus.Permanent(errors.New("card declined <for o-declined>"))
			}
			sc.State.Step = "paid"
			sc.Complete()
			return nil
		})
	routes, err := saga.Routes(b)
	require.NoError(t, err)
	sf := sagaFixture{fixture: f, chains: map[string]message.NoPublishHandlerFunc{}}
	for topic, r := range routes {
		sf.chains[topic], err = b.ConsumerChainTypes(ctx, "saga."+topic, r, nil, bus.WithUnknownTypes(bus.AckUnknown))
		require.NoError(t, err)
	}
	return sf
}

// deliver hands ev to the saga's handler of topic as the broker would after
// the relay: the envelope in the metadata.
func (f sagaFixture) deliver(t *testing.T, topic string, ev bus.Event, err error) {
	t.Helper()
	require.NoError(t, err)
	msg := message.NewMessage(watermill.NewUUID(), ev.Payload)
	msg.Metadata = message.Metadata{bus.EventIDKey: msg.UUID, bus.EventTypeKey: ev.Type, bus.AggregateTypeKey: ev.AggregateType,
		bus.AggregateIDKey: ev.AggregateID, bus.SchemaVersionKey: "1"}
	msg.SetContext(context.Background())
	require.NoError(t, f.chains[topic](msg))
}

// A saga instance's page shows its last error, escaped, and none while no
// step failed.
func TestSagaPageShowsLastError(t *testing.T) {
	t.Parallel()
	f := newSagaFixture(t)
	orders := bus.Must(bus.NewTopic[orderPlaced]("orders.events"))
	payments := bus.Must(bus.NewTopic[paymentCharged]("payments.events"))
	ev, err := orders.Event(orderPlaced{orderRef{"o-declined"}})
	f.deliver(t, "orders.events", ev, err)
	c := newClient(t, f.serve(t, console.Options{}, "").URL)
	code, body := c.get("/sagas/order_fulfilment/o-declined")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "No step has failed.")

	ev, err = payments.Event(paymentCharged{orderRef{"o-declined"}})
	f.deliver(t, "payments.events", ev, err) // poisoned: the step's error is permanent
	code, body = c.get("/sagas/order_fulfilment/o-declined")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `id="last-error"`)
	require.Contains(t, body, "<dd>PaymentCharged</dd>")
	require.Contains(t, body, "card declined &lt;for o-declined&gt;")
	require.Contains(t, body, "the saga has not moved on since")
}

// The saga pages list running instances (completed ones on request), show
// one with its state indented and its pending timeout's due time, and the
// scheduled events page lists that timeout.
func TestSagaPages(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newSagaFixture(t)
	orders := bus.Must(bus.NewTopic[orderPlaced]("orders.events"))
	payments := bus.Must(bus.NewTopic[paymentCharged]("payments.events"))
	const odd = "o/1 ü" // a correlation id that needs escaping in a path
	for _, id := range []string{odd, "o-2"} {
		ev, err := orders.Event(orderPlaced{orderRef{id}})
		f.deliver(t, "orders.events", ev, err)
	}
	ev, err := payments.Event(paymentCharged{orderRef{"o-2"}})
	f.deliver(t, "payments.events", ev, err)
	scheduled, err := f.ops.ListScheduled(ctx, 0)
	require.NoError(t, err)
	require.Len(t, scheduled.Events, 1, "the running instance's payment timeout; the completed one's is cancelled")
	timeout := scheduled.Events[0]

	srv := f.serve(t, console.Options{}, "/ops")
	c := newClient(t, srv.URL+"/ops")
	link := `href="/ops/sagas/order_fulfilment/o%2F1%20%C3%BC"`
	code, body := c.get("/sagas")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `href="/ops/sagas" class="on"`, "the nav marks the page")
	require.Contains(t, body, link)
	require.Contains(t, body, "<td>OrderPlaced</td>")
	require.Regexp(t, `<td>running</td><td class="num">1</td>`, body, "running, with one pending timeout")
	require.NotContains(t, body, "o-2", "a completed instance is listed on request only")

	code, body = c.get("/sagas?state=all&saga=order_fulfilment&limit=1")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "o-2", "the most recently changed first")
	require.Contains(t, body, "<td>completed</td>")
	require.NotContains(t, body, link, "the limit")
	require.Contains(t, body, "More instances match: showing 1")
	require.Contains(t, body, `<option value="all" selected>`)
	code, body = c.get("/sagas?saga=shipping")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "No saga instances match")

	code, body = c.get("/sagas/order_fulfilment/o%2F1%20%C3%BC")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "Saga order_fulfilment "+odd)
	require.Contains(t, body, `href="/ops/static/console.css"`, "an escaped path keeps the mount prefix")
	require.Contains(t, body, `href="/ops/scheduled"`)
	require.Contains(t, body, "\n  &#34;Step&#34;: &#34;charging&#34;,\n", "the state, indented")
	require.Contains(t, body, fmt.Sprintf("<tr><td>payment</td><td>%s</td><td>orders.saga-timeouts</td><td>%s</td></tr>",
		timeout.ID, timeout.DueAt.UTC().Format("2006-01-02 15:04:05Z")))
	code, body = c.get("/sagas/order_fulfilment/o-2")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "completed at ")
	require.Contains(t, body, "Pending timeouts (0)")
	code, _ = c.get("/sagas/order_fulfilment/nobody")
	require.Equal(t, http.StatusNotFound, code)

	code, body = c.get("/scheduled")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "1 event(s) scheduled")
	require.Contains(t, body, fmt.Sprintf("<td>orders.saga-timeouts</td><td>%s</td><td>PaymentTimedOut</td>", timeout.ID))

	require.NoError(t, f.ops.CancelScheduled(ctx, timeout.ID))
	_, body = c.get("/sagas/order_fulfilment/o%2F1%20%C3%BC")
	require.Contains(t, body, fmt.Sprintf("<tr><td>payment</td><td>%s</td><td>-</td><td>no longer scheduled", timeout.ID),
		"a timeout the instance still names but that is not scheduled any more")
}

// Skipping selected messages from the DLQ list: a dry run, then the skip
// with its token; the quarantine has no skip.
func TestSkipSelected(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 2, bus.Config{})
	c := newClient(t, f.serve(t, console.Options{}, "").URL)
	_, body := c.get("/dlq")
	require.Contains(t, body, `id="skip-selected"`)
	token := c.csrf("/dlq")
	selected := url.Values{"csrf": {token}, "id": {fmt.Sprint(f.ids[0]), fmt.Sprint(f.ids[1])}}
	code, body := c.post("/dlq/skip", selected)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "2 would be skipped for good, releasing 0 parked aggregate(s)")
	selected.Set("expect", expectField.FindStringSubmatch(body)[1])
	code, body = c.post("/dlq/skip", selected)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "2 skipped; 0 parked aggregate(s) flow on without them")
	for _, id := range f.ids {
		m, err := f.ops.DLQ().Get(context.Background(), id)
		require.NoError(t, err)
		require.Equal(t, ops.PoisonStateSkipped, m.State)
	}
	code, body = c.post("/quarantine/skip", url.Values{"csrf": {token}, "id": {fmt.Sprint(f.qids[0])}})
	require.Equal(t, http.StatusNotFound, code)
	require.Contains(t, body, "only poisoned messages")
}
