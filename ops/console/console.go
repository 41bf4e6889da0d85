package console

import (
	"cmp"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace-io/millrace/ops"
)

// Options configure the console. The zero Options is a console without
// authentication that allows actions: mount it behind your own auth, or
// set Token or BasicUser and BasicPassword.
type Options struct {
	// ReadOnly hides the actions and refuses every replay and purge with 403.
	ReadOnly bool
	// Token, when set, is required on every page: as "Authorization: Bearer
	// <token>", or entered once in the login form, which sets a session
	// cookie (HttpOnly, SameSite=Strict) holding a MAC of it, never the
	// token itself. Defaults to none.
	Token string
	// BasicUser and BasicPassword, when both set, require HTTP basic
	// authentication on every page. Defaults to none.
	BasicUser, BasicPassword string
	// By names who acts, in replay histories. Defaults to "console"; with
	// basic authentication, "console:<user>".
	By string
	// Logger receives the errors of pages that failed, and of samples.
	// Defaults to slog.Default().
	Logger *slog.Logger
	// SampleInterval is how often the console samples, for the overview's
	// charts, what the database keeps no history of: each relay group's
	// oldest pending age and, with Metrics, each consumer group's backlog.
	// It keeps the last hour of samples in memory (at most 3600 per group),
	// until Close. Defaults to 1m.
	SampleInterval time.Duration
	// Metrics is the Prometheus registry of the Bus that runs the consumers
	// in this process (the one given to bus.WithRegistry): the console
	// samples their millrace_consumer_backlog (on brokers that report it)
	// for the overview's lag charts. Defaults to none: no lag charts, as in
	// `millrace ui`, which runs apart from the consumers.
	Metrics prometheus.Gatherer
}

// Cookie names.
const (
	sessionCookie = "millrace_console_session"
	authCookie    = "millrace_console_auth"
)

//go:embed assets
var assets embed.FS

// Console is the web console: an http.Handler, and the sampler behind the
// overview's charts, which Close stops.
type Console struct {
	ops     *ops.Client
	opts    Options
	key     []byte // MACs of CSRF tokens and auth cookies; new per process
	pages   *template.Template
	mux     *http.ServeMux
	handler http.Handler // mux behind the cross-origin protection and serve
	log     *slog.Logger
	samples *sampler
}

// New returns the console over ops, sampling for its charts until Close.
// It fails when Options are contradictory (a basic-auth user without a
// password, or the reverse) or SampleInterval is negative.
func New(oc *ops.Client, opts Options) (*Console, error) {
	switch {
	case oc == nil:
		return nil, errors.New("console: New needs the operations API (ops.New)")
	case (opts.BasicUser == "") != (opts.BasicPassword == ""):
		return nil, errors.New("console: BasicUser and BasicPassword go together")
	case opts.SampleInterval < 0:
		return nil, fmt.Errorf("console: SampleInterval must not be negative; got %s", opts.SampleInterval)
	}
	c := &Console{ops: oc, opts: opts, key: make([]byte, 32), log: cmp.Or(opts.Logger, slog.Default())}
	if _, err := rand.Read(c.key); err != nil {
		return nil, fmt.Errorf("console: session key: %w", err)
	}
	pages, err := template.New("").Funcs(funcs).ParseFS(assets, "assets/*.html")
	if err != nil {
		return nil, fmt.Errorf("console: templates: %w", err)
	}
	c.pages = pages
	static, _ := fs.Sub(assets, "assets")
	c.mux = http.NewServeMux()
	c.mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	c.mux.HandleFunc("GET /login", c.loginPage)
	c.mux.HandleFunc("POST /login", c.login)
	c.mux.HandleFunc("GET /{$}", c.overview)
	c.mux.HandleFunc("GET /dlq", c.dlqList)
	c.mux.HandleFunc("GET /dlq/groups", c.dlqGroups)
	c.mux.HandleFunc("GET /dlq/parked", c.parkedList)
	c.mux.HandleFunc("GET /dlq/{id}", c.dlqShow)
	c.mux.HandleFunc("POST /dlq/{action}", c.dlqAction)
	c.mux.HandleFunc("GET /quarantine", c.quarantineList)
	c.mux.HandleFunc("GET /quarantine/{id}", c.quarantineShow)
	c.mux.HandleFunc("POST /quarantine/{action}", c.quarantineAction)
	c.mux.HandleFunc("GET /sagas", c.sagaList)
	c.mux.HandleFunc("GET /sagas/{saga}/{id}", c.sagaShow)
	c.mux.HandleFunc("GET /scheduled", c.scheduledList)
	protect := http.NewCrossOriginProtection()
	protect.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c.fail(w, r, http.StatusForbidden, "cross-origin request refused")
	}))
	c.handler = protect.Handler(http.HandlerFunc(c.serve))
	c.samples = startSampler(oc, opts.Metrics, cmp.Or(opts.SampleInterval, time.Minute), c.log)
	return c, nil
}

// ServeHTTP serves the console's pages.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) { c.handler.ServeHTTP(w, r) }

// Close stops the sampling and waits for it to end; the pages keep
// working, their sampled charts no longer move. It is idempotent and
// returns nil.
func (c *Console) Close() error {
	c.samples.close()
	return nil
}

// serve sets the security headers, the session, and checks authentication
// and, for actions, the CSRF token, before the page runs.
func (c *Console) serve(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "+
		"form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cache-Control", "no-store")
	if strings.HasPrefix(r.URL.Path, "/static/") {
		c.mux.ServeHTTP(w, r) // styles and script hold nothing secret; the login page needs them
		return
	}
	session := c.session(w, r)
	if !c.authenticated(r) && !(r.URL.Path == "/login" && c.opts.Token != "") {
		if c.opts.BasicUser != "" {
			h.Set("WWW-Authenticate", `Basic realm="millrace console", charset="UTF-8"`)
			c.fail(w, r, http.StatusUnauthorized, "authentication required")
			return
		}
		w.WriteHeader(http.StatusUnauthorized)
		c.render(w, r, "login", page{Title: "Sign in", CSRF: c.csrf(session)})
		return
	}
	if r.Method == http.MethodPost {
		if c.opts.ReadOnly && r.URL.Path != "/login" {
			c.fail(w, r, http.StatusForbidden, "the console is read-only: replay and purge are turned off")
			return
		}
		if err := r.ParseForm(); err != nil {
			c.fail(w, r, http.StatusBadRequest, "unreadable form: "+err.Error())
			return
		}
		if !hmac.Equal([]byte(r.PostForm.Get("csrf")), []byte(c.csrf(session))) {
			c.fail(w, r, http.StatusForbidden, "missing or wrong CSRF token: reload the page and try again")
			return
		}
	}
	c.mux.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), sessionKey{}, session)))
}

// sessionKey carries the visitor's session id to the pages.
type sessionKey struct{}

// session returns the visitor's session id, setting a new one when there
// is none.
func (c *Console) session(w http.ResponseWriter, r *http.Request) string {
	if ck, err := r.Cookie(sessionCookie); err == nil && len(ck.Value) == 64 {
		if _, err := hex.DecodeString(ck.Value); err == nil {
			return ck.Value
		}
	}
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	id := hex.EncodeToString(b)
	// The cookie is the session as it is now: a POST in this same request
	// cannot carry a token for it yet, and is refused.
	r.Header.Del("Cookie")
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: id, Path: "/", HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil})
	return id
}

// csrf is the CSRF token of session: a MAC only this process can make.
func (c *Console) csrf(session string) string { return c.mac("csrf:" + session) }

func (c *Console) mac(s string) string {
	m := hmac.New(sha256.New, c.key)
	m.Write([]byte(s))
	return hex.EncodeToString(m.Sum(nil))
}

// authenticated reports whether r passes the configured authentication.
func (c *Console) authenticated(r *http.Request) bool {
	if c.opts.BasicUser != "" {
		user, pass, ok := r.BasicAuth()
		return ok && equal(user, c.opts.BasicUser) && equal(pass, c.opts.BasicPassword)
	}
	if c.opts.Token == "" {
		return true
	}
	if bearer, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok && equal(bearer, c.opts.Token) {
		return true
	}
	ck, err := r.Cookie(authCookie)
	return err == nil && hmac.Equal([]byte(ck.Value), []byte(c.mac("auth:"+c.opts.Token)))
}

func equal(a, b string) bool { return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1 }

// by names who acts for the replay history.
func (c *Console) by(r *http.Request) string {
	if user, _, ok := r.BasicAuth(); ok && c.opts.BasicUser != "" {
		return "console:" + user
	}
	return cmp.Or(c.opts.By, "console")
}

func (c *Console) loginPage(w http.ResponseWriter, r *http.Request) {
	if c.opts.Token == "" {
		http.Redirect(w, r, base(r)+"/", http.StatusSeeOther)
		return
	}
	c.render(w, r, "login", page{Title: "Sign in", CSRF: c.csrf(c.session(w, r))})
}

// login checks the token entered in the login form and sets the auth cookie.
func (c *Console) login(w http.ResponseWriter, r *http.Request) {
	if c.opts.Token == "" || !equal(r.PostForm.Get("token"), c.opts.Token) {
		w.WriteHeader(http.StatusUnauthorized)
		c.render(w, r, "login", page{Title: "Sign in", CSRF: c.csrf(c.session(w, r)), Error: "wrong token"})
		return
	}
	http.SetCookie(w, &http.Cookie{Name: authCookie, Value: c.mac("auth:" + c.opts.Token), Path: "/", HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil})
	http.Redirect(w, r, base(r)+"/", http.StatusSeeOther)
}

// base is the path prefix the console is mounted under ("" at the root):
// what http.StripPrefix took off the request's path. Both sides are
// compared escaped, so that a path with an escaped segment (a saga's
// correlation id holding a slash) keeps its prefix.
func base(r *http.Request) string {
	full, _, _ := strings.Cut(r.RequestURI, "?")
	return strings.TrimSuffix(strings.TrimSuffix(full, r.URL.EscapedPath()), "/")
}

// page is what every template gets.
type page struct {
	Title    string
	Nav      string // the section: outbox, dlq, groups, parked, quarantine, sagas, scheduled
	Base     string
	CSRF     string
	ReadOnly bool
	Error    string
	Data     any
}

// render writes the template name with p, filling in the request's parts.
func (c *Console) render(w http.ResponseWriter, r *http.Request, name string, p page) {
	p.Base, p.ReadOnly = base(r), c.opts.ReadOnly
	if session, ok := r.Context().Value(sessionKey{}).(string); ok && p.CSRF == "" {
		p.CSRF = c.csrf(session)
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	if err := c.pages.ExecuteTemplate(w, name, p); err != nil {
		c.log.Error("console: render page", "page", name, "error", err)
	}
}

// fail answers status with the reason, as a page.
func (c *Console) fail(w http.ResponseWriter, r *http.Request, status int, reason string) {
	w.WriteHeader(status)
	c.render(w, r, "error", page{Title: http.StatusText(status), Error: reason, Data: status})
}

// failErr answers a failed operation: 404 for ids that do not exist, 409
// for a selection that changed, 400 for an invalid one, 500 otherwise.
func (c *Console) failErr(w http.ResponseWriter, r *http.Request, err error) {
	switch {
	case errors.Is(err, ops.ErrNotFound) && r.Method == http.MethodGet:
		c.fail(w, r, http.StatusNotFound, err.Error())
	case errors.Is(err, ops.ErrNotFound):
		c.fail(w, r, http.StatusConflict, err.Error()+": purged meanwhile? nothing was done; review the selection again")
	case errors.Is(err, ops.ErrNotSupported):
		c.fail(w, r, http.StatusNotFound, err.Error())
	case errors.Is(err, ops.ErrChanged):
		c.fail(w, r, http.StatusConflict, err.Error())
	case errors.As(err, new(badInput)), errors.Is(err, ops.ErrInvalidSelection), errors.Is(err, ops.ErrInvalidFilter):
		c.fail(w, r, http.StatusBadRequest, err.Error())
	default:
		c.log.Error("console: operation failed", "path", r.URL.Path, "error", err)
		c.fail(w, r, http.StatusInternalServerError, err.Error())
	}
}
