//go:build !race

package nats

// raceEnabled reports that the tests run with the race detector.
const raceEnabled = false
