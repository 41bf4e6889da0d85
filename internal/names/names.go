package names

import (
	"fmt"
	"hash/fnv"
	"regexp"
	"strings"
	"unicode"
	"unicode/utf8"
)

// MaxTopicLength is Kafka's limit on topic names, the strictest of the three brokers.
const MaxTopicLength = 249

var (
	topicPattern      = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)
	identifierPattern = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)
)

// Topic checks a broker topic or consumer-group name: letters, digits, '.', '_'
// and '-', starting with a letter or digit, at most 249 characters. That set is
// valid on Kafka, RabbitMQ and NATS alike.
func Topic(name string) error {
	return check(name, MaxTopicLength, topicPattern, "letters, digits, '.', '_', '-'")
}

// Identifier checks a name that becomes part of an SQL identifier: lowercase
// letters, digits and '_', not starting with a digit, at most maxLen bytes.
func Identifier(name string, maxLen int) error {
	return check(name, maxLen, identifierPattern, "lowercase letters, digits, '_'")
}

// check refuses an empty name, one longer than maxLen, and one pattern does
// not match (allowed says what it allows).
func check(name string, maxLen int, pattern *regexp.Regexp, allowed string) error {
	switch {
	case name == "":
		return fmt.Errorf("must not be empty")
	case len(name) > maxLen:
		return fmt.Errorf("must be at most %d characters, got %d", maxLen, len(name))
	case !pattern.MatchString(name):
		return fmt.Errorf("must match %s (%s), got %q", pattern, allowed, name)
	}
	return nil
}

// Derived joins parts with '_' into a name that Identifier(name, maxLen)
// accepts: letters lowercased, any other character than a lowercase
// letter, a digit or '_' replaced by '_', a '_' in front of a leading
// digit, and, when longer than maxLen (at least 16), cut to maxLen-9 bytes
// and ended by '_' and 8 hex digits of a hash of the whole, so that names
// with the same beginning stay apart.
func Derived(maxLen int, parts ...string) string {
	name := strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9', r == '_':
			return r
		case r >= 'A' && r <= 'Z':
			return r + 'a' - 'A'
		}
		return '_'
	}, strings.Join(parts, "_"))
	if name == "" || name[0] >= '0' && name[0] <= '9' {
		name = "_" + name
	}
	if len(name) > maxLen {
		h := fnv.New32a()
		h.Write([]byte(name))
		name = fmt.Sprintf("%s_%08x", name[:maxLen-9], h.Sum32())
	}
	return name
}

// Schema checks a PostgreSQL schema name: an Identifier of at most maxLen
// bytes that is not one PostgreSQL keeps for itself (pg_catalog, pg_temp,
// pg_toast and every other name starting with "pg_", information_schema):
// tables there are system tables, temporary, or cannot be created at all.
func Schema(name string, maxLen int) error {
	if err := Identifier(name, maxLen); err != nil {
		return err
	}
	if strings.HasPrefix(name, "pg_") || name == "information_schema" {
		return fmt.Errorf("must not be a schema PostgreSQL reserves (pg_*, information_schema), got %q", name)
	}
	return nil
}

// Text checks an id or name carried as a broker header and stored in text
// columns (an event id, type, aggregate type or id, a correlation id): valid
// UTF-8 (JSON would replace invalid bytes), no control characters
// (PostgreSQL text cannot hold NUL; NATS turns CR and LF into spaces) and no
// white space at either end (NATS trims it), so that two different ids never
// arrive as one.
func Text(s string) error {
	if !utf8.ValidString(s) {
		return fmt.Errorf("not valid UTF-8 at byte %d", invalidAt(s))
	}
	for i, r := range s {
		if unicode.IsControl(r) {
			return fmt.Errorf("control character %U at byte %d", r, i)
		}
	}
	if r, _ := utf8.DecodeRuneInString(s); unicode.IsSpace(r) {
		return fmt.Errorf("starts with white space %U", r)
	}
	if r, _ := utf8.DecodeLastRuneInString(s); unicode.IsSpace(r) {
		return fmt.Errorf("ends with white space %U", r)
	}
	return nil
}

// Value checks a metadata value: valid UTF-8 (JSON would replace invalid
// bytes) without NUL (PostgreSQL's text and jsonb cannot hold it).
func Value(s string) error {
	if !utf8.ValidString(s) {
		return fmt.Errorf("not valid UTF-8 at byte %d", invalidAt(s))
	}
	if i := strings.IndexByte(s, 0); i >= 0 {
		return fmt.Errorf("NUL byte at %d", i)
	}
	return nil
}

// invalidAt is the offset of the first byte of s that is not valid UTF-8.
func invalidAt(s string) int {
	for i, r := range s {
		if r == utf8.RuneError {
			if _, size := utf8.DecodeRuneInString(s[i:]); size == 1 {
				return i
			}
		}
	}
	return len(s)
}
