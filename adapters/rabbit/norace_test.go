//go:build !race

package rabbit

// raceEnabled reports whether the race detector is on.
const raceEnabled = false
