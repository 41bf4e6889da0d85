package testkit

import (
	"path"
	"slices"
	"sync"
	"testing"
)

func TestEachRunsEveryNameInParallel(t *testing.T) {
	t.Parallel()
	names := []string{"a", "b", "c"}
	var mu sync.Mutex
	var ran []string
	t.Run("group", func(t *testing.T) {
		Each(t, names, func(t *testing.T, name string) {
			if got := path.Base(t.Name()); got != name {
				t.Errorf("subtest %q runs the test of %q", got, name)
			}
			mu.Lock()
			ran = append(ran, name)
			mu.Unlock()
		})
		// A parallel subtest waits for its parent's function to return.
		mu.Lock()
		defer mu.Unlock()
		if len(ran) != 0 {
			t.Errorf("subtests %v ran before the group returned: not parallel", ran)
		}
	})
	slices.Sort(ran)
	if !slices.Equal(ran, names) {
		t.Fatalf("ran %v, want every one of %v", ran, names)
	}
}
