package testkit

import (
	"crypto/rand"
	"encoding/hex"
)

// Suffix returns 8 random hex digits, for names (schemas, topics, groups,
// event ids) that must not meet another test's.
func Suffix() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
