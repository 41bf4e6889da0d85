package confload

import (
	"fmt"
	"net/url"
	"slices"
	"strings"
	"time"
)

// Checker collects configuration problems; its methods each check one rule.
type Checker struct {
	Problems []error
}

// Add records a problem at path.
func (c *Checker) Add(path, format string, args ...any) {
	c.Problems = append(c.Problems, Errorf(path, format, args...))
}

// Merge records problems found elsewhere (an adapter's section).
func (c *Checker) Merge(errs []error) {
	c.Problems = append(c.Problems, errs...)
}

// OneOf checks that value is one of allowed.
func (c *Checker) OneOf(path, value string, allowed ...string) {
	if !slices.Contains(allowed, value) {
		c.Add(path, "must be one of %s; got %q", strings.Join(allowed, ", "), value)
	}
}

// URL checks that value is a URL with one of the given schemes, without
// echoing any password it holds.
func (c *Checker) URL(path, value string, schemes ...string) {
	if value == "" {
		c.Add(path, "required: a %s:// URL", schemes[0])
		return
	}
	u, err := url.Parse(value)
	if err != nil {
		c.Add(path, "not a valid URL: %s", redactErr(err, value))
		return
	}
	if !slices.Contains(schemes, u.Scheme) {
		c.Add(path, "URL scheme must be one of %s; got %q in %s", strings.Join(schemes, ", "), u.Scheme, RedactURL(value))
	}
	if u.Host == "" && u.Opaque == "" {
		c.Add(path, "URL has no host: %s", RedactURL(value))
	}
}

// secretParams are query parameters that carry secrets (PostgreSQL's
// password and sslpassword, a token).
var secretParams = []string{"password", "sslpassword", "token"}

// RedactURL returns raw with its password, and any secret query parameter,
// replaced by "xxxxx", for errors and logs. A user without a password is
// replaced too: it may be a token (nats://token@host). An unparsable URL is
// replaced whole: its text may hold a password.
func RedactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "<unparsable URL>"
	}
	if u.User != nil {
		if _, ok := u.User.Password(); !ok {
			u.User = url.User("xxxxx")
		}
	}
	if u.RawQuery != "" {
		q := u.Query()
		changed := false
		for _, p := range secretParams {
			if q.Has(p) {
				q.Set(p, "xxxxx")
				changed = true
			}
		}
		if changed {
			u.RawQuery = q.Encode()
		}
	}
	return u.Redacted()
}

// Positive checks value > 0.
func (c *Checker) Positive(path string, value int) {
	if value <= 0 {
		c.Add(path, "must be greater than 0; got %d", value)
	}
}

// NonNegative checks value >= 0.
func (c *Checker) NonNegative(path string, value int) {
	if value < 0 {
		c.Add(path, "must not be negative; got %d", value)
	}
}

// PositiveDuration checks d > 0.
func (c *Checker) PositiveDuration(path string, d time.Duration) {
	if d <= 0 {
		c.Add(path, "must be a positive duration such as \"5s\"; got %s", d)
	}
}

// NonNegativeDuration checks d >= 0.
func (c *Checker) NonNegativeDuration(path string, d time.Duration) {
	if d < 0 {
		c.Add(path, "must not be a negative duration; got %s", d)
	}
}

// Check records a problem at path when err is not nil.
func (c *Checker) Check(path string, err error) {
	if err != nil {
		c.Add(path, "%v", err)
	}
}

// redactErr returns err's text with the raw (possibly secret-bearing) value removed.
func redactErr(err error, raw string) string {
	if ue, ok := err.(*url.Error); ok {
		return fmt.Sprintf("%s: %v", ue.Op, ue.Err)
	}
	return strings.ReplaceAll(err.Error(), raw, "<url>")
}
