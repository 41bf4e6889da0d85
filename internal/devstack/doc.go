// Package devstack is the local stack behind `make up`, `make down` and
// `make status`: stack.sh, and the tests that run it against fake servers
// and fake installers (apt-get, Homebrew, systemd's NATS) on PATH.
package devstack
