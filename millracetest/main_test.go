package millracetest_test

import (
	"testing"

	"go.uber.org/goleak"
)

// No delivery, crashed or not, leaves a goroutine behind.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
