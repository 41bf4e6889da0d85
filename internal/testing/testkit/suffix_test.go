package testkit

import (
	"regexp"
	"testing"
)

func TestSuffixIsEightFreshHexDigits(t *testing.T) {
	t.Parallel()
	a, b := Suffix(), Suffix()
	if !regexp.MustCompile(`^[0-9a-f]{8}$`).MatchString(a) {
		t.Fatalf("Suffix() = %q, want 8 lowercase hex digits", a)
	}
	if a == b {
		t.Fatalf("two calls gave the same suffix %q", a)
	}
}
