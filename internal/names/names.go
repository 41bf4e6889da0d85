// Package names validates the names millrace passes on to SQL and to brokers
// (topics, consumer groups, schemas), so a hostile or mistyped name is refused
// with a clear error before it reaches a query or a broker.
package names

import (
	"fmt"
	"regexp"
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
	switch {
	case name == "":
		return fmt.Errorf("must not be empty")
	case len(name) > MaxTopicLength:
		return fmt.Errorf("must be at most %d characters, got %d", MaxTopicLength, len(name))
	case !topicPattern.MatchString(name):
		return fmt.Errorf("must match %s (letters, digits, '.', '_', '-'), got %q", topicPattern, name)
	}
	return nil
}

// Identifier checks a name that becomes part of an SQL identifier: lowercase
// letters, digits and '_', not starting with a digit, at most maxLen bytes.
func Identifier(name string, maxLen int) error {
	switch {
	case name == "":
		return fmt.Errorf("must not be empty")
	case len(name) > maxLen:
		return fmt.Errorf("must be at most %d characters, got %d", maxLen, len(name))
	case !identifierPattern.MatchString(name):
		return fmt.Errorf("must match %s (lowercase letters, digits, '_'), got %q", identifierPattern, name)
	}
	return nil
}
