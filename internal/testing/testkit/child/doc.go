// Package child runs the test binary again as a child process playing a
// role, for tests that kill a process at a chosen point (test-only).
//
// The parent calls Start with a role and the child's environment; the
// child, this same test binary, finds its role with Role (in TestMain, or
// in a test the parent's Options.Run selects), may print the ready line
// with Ready once it has reached the point the parent waits for, and runs
// until it is killed, stopped or exits. A child still running when its
// test ends is killed.
package child
