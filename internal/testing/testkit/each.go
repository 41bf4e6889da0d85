package testkit

import "testing"

// Each runs test once per name, each in a subtest of that name that runs
// in parallel with the others. It does not mark t itself parallel.
func Each(t *testing.T, names []string, test func(t *testing.T, name string)) {
	t.Helper()
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			test(t, name)
		})
	}
}
