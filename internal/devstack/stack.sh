#!/usr/bin/env bash
# Local stack for millrace's tests and demo: PostgreSQL, RabbitMQ and NATS
# (JetStream) on their standard local ports, and a headless chromium for
# the web console's browser tests.
#
#   stack.sh up      reuse running servers, start installed ones, install
#                    missing ones (and chromium) with apt-get (Debian/Ubuntu);
#                    print what it did
#   stack.sh down    stop what `up` started, and nothing else
#   stack.sh status  show what answers on each port
#
# A service whose URL points elsewhere (DATABASE_URL, AMQP_URL, NATS_URL set to
# a non-local host) is left alone. State lives in $MILLRACE_STACK_DIR (.stack).
set -euo pipefail

STATE_DIR=${MILLRACE_STACK_DIR:-.stack}
STARTED="$STATE_DIR/started"
mkdir -p "$STATE_DIR"
touch "$STARTED"

say() { printf '%-11s %s\n' "$1" "$2"; }
die() { printf 'make up: %s\n' "$*" >&2; exit 1; }

if [ "$(id -u)" = 0 ]; then SUDO=(); elif command -v sudo >/dev/null; then SUDO=(sudo); else SUDO=(); fi
as_root() {
	if [ "$(id -u)" != 0 ] && [ ${#SUDO[@]} -eq 0 ]; then die "need root or sudo to run: $*"; fi
	"${SUDO[@]}" "$@"
}

port_open() { timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

wait_port() { # port seconds name
	local i
	for ((i = 0; i < $2 * 5; i++)); do
		port_open "$1" && return 0
		sleep 0.2
	done
	die "$3 did not open port $1 within $2s"
}

remote() { # true when the URL in $1 names a host other than localhost
	[ -n "$1" ] || return 1
	case "$1" in *@127.0.0.1* | *@localhost* | *//127.0.0.1* | *//localhost* | *@\[::1\]* | *//\[::1\]*) return 1 ;; esac
	return 0
}

record() { grep -qx "$1" "$STARTED" || echo "$1" >>"$STARTED"; }

apt_install() {
	command -v apt-get >/dev/null || die "$1 is not installed and apt-get is not available: install $1 yourself (see README)"
	say "$1" "installing with apt-get"
	as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
	as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null
}

pg_version() { ls /etc/postgresql 2>/dev/null | sort -V | tail -n1; }

up_postgres() {
	if remote "${DATABASE_URL:-}"; then say postgresql "DATABASE_URL points elsewhere; not managed"; return; fi
	if port_open 5432; then say postgresql "reused the server on 127.0.0.1:5432"; return; fi
	local fresh=0
	if [ -z "$(pg_version)" ] || ! command -v pg_ctlcluster >/dev/null; then
		apt_install postgresql
		fresh=1
	fi
	local v
	v=$(pg_version)
	[ -n "$v" ] || die "postgresql is installed but has no cluster in /etc/postgresql"
	if ! port_open 5432; then
		as_root pg_ctlcluster --skip-systemctl-redirect "$v" main start
		record "postgresql $v"
	fi
	wait_port 5432 60 postgresql
	if [ "$fresh" = 1 ]; then
		# The default URL logs in as postgres/postgres over TCP.
		as_root su -s /bin/sh postgres -c "psql -q -c \"ALTER USER postgres PASSWORD 'postgres'\""
	fi
	say postgresql "started PostgreSQL $v on 127.0.0.1:5432"
}

up_rabbitmq() {
	if remote "${AMQP_URL:-}"; then say rabbitmq "AMQP_URL points elsewhere; not managed"; return; fi
	if port_open 5672; then say rabbitmq "reused the server on 127.0.0.1:5672"; return; fi
	command -v rabbitmq-server >/dev/null || apt_install rabbitmq-server
	if ! port_open 5672; then
		as_root rabbitmq-server -detached
		record rabbitmq
	fi
	as_root rabbitmqctl -q await_startup --timeout 120 >/dev/null 2>&1 || wait_port 5672 120 rabbitmq
	wait_port 5672 60 rabbitmq
	say rabbitmq "started RabbitMQ on 127.0.0.1:5672 (guest/guest)"
}

up_nats() {
	if remote "${NATS_URL:-}"; then say nats "NATS_URL points elsewhere; not managed"; return; fi
	if port_open 4222; then say nats "reused the server on 127.0.0.1:4222"; return; fi
	command -v nats-server >/dev/null || [ -x /usr/sbin/nats-server ] || apt_install nats-server
	local bin
	bin=$(command -v nats-server || echo /usr/sbin/nats-server)
	mkdir -p "$STATE_DIR/nats"
	nohup "$bin" -a 127.0.0.1 -p 4222 -js -sd "$(cd "$STATE_DIR" && pwd)/nats" >"$STATE_DIR/nats.log" 2>&1 &
	echo $! >"$STATE_DIR/nats.pid"
	record nats
	wait_port 4222 30 nats-server
	say nats "started nats-server with JetStream on 127.0.0.1:4222 (data in $STATE_DIR/nats)"
}

# The console's browser tests (bus/console) drive chromium headless; they
# fail, naming this target, when it is missing.
up_chromium() {
	local b
	for b in chromium chromium-browser google-chrome google-chrome-stable; do
		if command -v "$b" >/dev/null; then say chromium "found $(command -v "$b")"; return; fi
	done
	apt_install chromium
	command -v chromium >/dev/null || die "chromium was installed but is not on PATH"
	say chromium "installed $(chromium --version 2>/dev/null | head -n1)"
}

down() {
	local line
	while read -r line; do
		case "$line" in
		"postgresql "*)
			as_root pg_ctlcluster --skip-systemctl-redirect "${line#postgresql }" main stop && say postgresql "stopped" ;;
		rabbitmq)
			as_root rabbitmqctl -q shutdown >/dev/null 2>&1 || as_root rabbitmqctl -q stop >/dev/null 2>&1 || true
			say rabbitmq "stopped" ;;
		nats)
			if [ -f "$STATE_DIR/nats.pid" ]; then kill "$(cat "$STATE_DIR/nats.pid")" 2>/dev/null || true; rm -f "$STATE_DIR/nats.pid"; fi
			say nats "stopped" ;;
		esac
	done <"$STARTED"
	: >"$STARTED"
	say stack "left running whatever make up did not start"
}

status() {
	local p
	for p in postgresql:5432 rabbitmq:5672 nats:4222; do
		if port_open "${p#*:}"; then say "${p%:*}" "up on 127.0.0.1:${p#*:}"; else say "${p%:*}" "down"; fi
	done
	if command -v chromium >/dev/null; then say chromium "installed"; else say chromium "missing (make up installs it)"; fi
}

case "${1:-}" in
up) up_postgres; up_rabbitmq; up_nats; up_chromium ;;
down) down ;;
status) status ;;
*) die "usage: stack.sh up|down|status" ;;
esac
