#!/usr/bin/env bash
# Local stack for millrace's tests and demo: PostgreSQL, RabbitMQ and NATS
# (JetStream) on their standard local ports, pgbouncer (installed only: the
# tests start private poolers) and a headless chromium for the web
# console's browser tests.
#
#   stack.sh up [service...]  reuse running servers, start installed ones,
#                    install missing ones with apt-get (Debian/Ubuntu) or
#                    Homebrew (macOS); print what it did. Services:
#                    postgres rabbitmq nats nats-current pgbouncer chromium
#                    (default: all)
#   stack.sh down    stop what `up` started, and nothing else
#   stack.sh status  show what answers on each port
#
# A service whose URL points elsewhere (DATABASE_URL, AMQP_URL, NATS_URL set to
# a non-local host) is left alone. State lives in $MILLRACE_STACK_DIR (.stack).
# nats-current is a second, current nats-server (the version go.mod requires,
# built from the Go module into the cache the tests' private servers share) on
# port 4223 with a data directory of its own, started only when the server on
# the NATS port is older than 2.11; the NATS port's server is left as it is.
# MILLRACE_STACK_{PG,AMQP,NATS,NATS_CURRENT}_PORT move the ports the script looks at (its
# own tests use them; millrace's default URLs name the standard ports).
# MILLRACE_STACK_PGBOUNCER and MILLRACE_STACK_POLICY_RC_D move the paths of
# Debian's pgbouncer binary and of policy-rc.d (for the same tests).
# Docker users can run compose.yaml instead; the tests do not need Docker.
set -euo pipefail

PG_PORT=${MILLRACE_STACK_PG_PORT:-5432}
AMQP_PORT=${MILLRACE_STACK_AMQP_PORT:-5672}
NATS_PORT=${MILLRACE_STACK_NATS_PORT:-4222}
NATS_CURRENT_PORT=${MILLRACE_STACK_NATS_CURRENT_PORT:-4223}
NATS_CURRENT_BELOW=2.11 # a NATS-port server older than this gets a current one beside it
NATS_MODULE=github.com/nats-io/nats-server/v2
PGBOUNCER=${MILLRACE_STACK_PGBOUNCER:-/usr/sbin/pgbouncer}
POLICY_RC_D=${MILLRACE_STACK_POLICY_RC_D:-/usr/sbin/policy-rc.d}
STATE_DIR=${MILLRACE_STACK_DIR:-.stack}
STARTED="$STATE_DIR/started"
POLICY_SAVED="" # the policy-rc.d install_no_start set aside
mkdir -p "$STATE_DIR"
touch "$STARTED"

say() { printf '%-11s %s\n' "$1" "$2"; }
die() { printf 'make up: %s\n' "$*" >&2; exit 1; }

if [ "$(id -u)" = 0 ]; then SUDO=(); elif command -v sudo >/dev/null; then SUDO=(sudo); else SUDO=(); fi
as_root() {
	if [ "$(id -u)" != 0 ] && [ ${#SUDO[@]} -eq 0 ]; then die "need root or sudo to run: $*"; fi
	"${SUDO[@]}" "$@"
}

# A closed loopback port refuses at once, so the probe needs no timeout;
# GNU timeout (absent on macOS) only guards against a port that never answers.
port_open() {
	if command -v timeout >/dev/null; then
		timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null
	else
		bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null
	fi
}

# nats_info prints the INFO line a NATS server sends on connect to port $1.
nats_info() {
	bash -c 'exec 3<>/dev/tcp/127.0.0.1/'"$1"' && IFS= read -r -t 3 line <&3 && printf "%s\n" "$line"' 2>/dev/null || true
}

# jetstream_on: the NATS server on port $1 has JetStream enabled.
jetstream_on() { nats_info "$1" | grep -q '"jetstream":true'; }

# nats_version prints the version the NATS server on port $1 reports
# (2.9.10), nothing when none answers.
nats_version() {
	local line
	line=$(nats_info "$1")
	if [[ $line =~ \"version\":\"([0-9.]+) ]]; then echo "${BASH_REMATCH[1]}"; fi
}

# version_below: dotted version $1 is older than $2.
version_below() {
	local IFS=. i a b
	read -ra a <<<"$1"
	read -ra b <<<"$2"
	for i in 0 1 2; do
		if ((${a[i]:-0} < ${b[i]:-0})); then return 0; fi
		if ((${a[i]:-0} > ${b[i]:-0})); then return 1; fi
	done
	return 1
}

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

macos() { [ "$(uname -s)" = Darwin ]; }

# brew_formula maps a Debian package name to its Homebrew formula.
brew_formula() {
	case "$1" in
	postgresql) echo postgresql@16 ;;
	rabbitmq-server) echo rabbitmq ;;
	chromium) echo --cask chromium ;;
	*) echo "$1" ;;
	esac
}

# install $1 (a Debian package name) with apt-get or, on macOS, Homebrew.
install() {
	if macos; then
		command -v brew >/dev/null || die "$1 is not installed and Homebrew is not available: install Homebrew (https://brew.sh) or $1 yourself (see README)"
		say "$1" "installing with Homebrew"
		# shellcheck disable=SC2046 # the formula may carry --cask
		brew install -q $(brew_formula "$1") >/dev/null
		return
	fi
	command -v apt-get >/dev/null || die "$1 is not installed and apt-get is not available: install $1 yourself (see README)"
	say "$1" "installing with apt-get"
	as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
	as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null
}

# brew_start starts a Homebrew service and records it for `down`.
brew_start() { # formula name port
	brew services start "$1" >/dev/null
	record "brew $1"
	wait_port "$3" 60 "$2"
}

pg_version() { ls /etc/postgresql 2>/dev/null | sort -V | tail -n1; }

up_postgres() {
	if remote "${DATABASE_URL:-}"; then say postgresql "DATABASE_URL points elsewhere; not managed"; return; fi
	if port_open "$PG_PORT"; then say postgresql "reused the server on 127.0.0.1:$PG_PORT"; return; fi
	if macos; then
		command -v pg_ctl >/dev/null || install postgresql
		brew_start postgresql@16 postgresql "$PG_PORT"
		# Homebrew's superuser is the login user; the default URL logs in as postgres/postgres.
		psql -q -d postgres -c "DO \$\$BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'postgres') THEN CREATE ROLE postgres SUPERUSER LOGIN PASSWORD 'postgres'; END IF; END\$\$" >/dev/null
		say postgresql "started PostgreSQL (Homebrew) on 127.0.0.1:$PG_PORT"
		return
	fi
	local fresh=0
	if [ -z "$(pg_version)" ] || ! command -v pg_ctlcluster >/dev/null; then
		install postgresql
		fresh=1
	fi
	local v
	v=$(pg_version)
	[ -n "$v" ] || die "postgresql is installed but has no cluster in /etc/postgresql"
	if ! port_open "$PG_PORT"; then
		as_root pg_ctlcluster --skip-systemctl-redirect "$v" main start
		record "postgresql $v"
	fi
	wait_port "$PG_PORT" 60 postgresql
	if [ "$fresh" = 1 ]; then
		# The default URL logs in as postgres/postgres over TCP.
		as_root su -s /bin/sh postgres -c "psql -q -c \"ALTER USER postgres PASSWORD 'postgres'\""
	fi
	say postgresql "started PostgreSQL $v on 127.0.0.1:$PG_PORT"
}

# wal_advice says how to let the WAL relay (relay.source: wal) read the
# PostgreSQL server: it reads wal_level and never changes a setting.
wal_advice() {
	local url=${DATABASE_URL:-postgres://postgres:postgres@127.0.0.1:$PG_PORT/postgres} level=""
	if command -v psql >/dev/null; then level=$(PGCONNECT_TIMEOUT=3 psql "$url" -Atqc "SHOW wal_level" 2>/dev/null || true); fi
	local how="ALTER SYSTEM SET wal_level = logical (as a superuser), then restart PostgreSQL; make up changes no setting (see docs/WAL.md)"
	case "$level" in
	logical) say wal "wal_level = logical: relay.source: wal can run here (its role needs REPLICATION)" ;;
	"") say wal "relay.source: wal needs wal_level = logical: $how" ;;
	*) say wal "wal_level = $level; relay.source: wal needs logical: $how" ;;
	esac
}

up_rabbitmq() {
	if remote "${AMQP_URL:-}"; then say rabbitmq "AMQP_URL points elsewhere; not managed"; return; fi
	if port_open "$AMQP_PORT"; then say rabbitmq "reused the server on 127.0.0.1:$AMQP_PORT"; return; fi
	if macos; then
		command -v rabbitmq-server >/dev/null || install rabbitmq-server
		brew_start rabbitmq rabbitmq "$AMQP_PORT"
		say rabbitmq "started RabbitMQ (Homebrew) on 127.0.0.1:$AMQP_PORT (guest/guest)"
		return
	fi
	command -v rabbitmq-server >/dev/null || install rabbitmq-server
	if ! port_open "$AMQP_PORT"; then
		as_root rabbitmq-server -detached
		record rabbitmq
	fi
	as_root rabbitmqctl -q await_startup --timeout 120 >/dev/null 2>&1 || wait_port "$AMQP_PORT" 120 rabbitmq
	wait_port "$AMQP_PORT" 60 rabbitmq
	say rabbitmq "started RabbitMQ on 127.0.0.1:$AMQP_PORT (guest/guest)"
}

up_nats() {
	if remote "${NATS_URL:-}"; then say nats "NATS_URL points elsewhere; not managed"; return; fi
	if port_open "$NATS_PORT"; then
		# A distribution's nats-server service (Debian's starts one) runs
		# without JetStream on the standard port; millrace cannot use it.
		jetstream_on "$NATS_PORT" || die "the NATS server on 127.0.0.1:$NATS_PORT has no JetStream: stop it (e.g. systemctl disable --now nats-server) and run make up again, or point NATS_URL at a server started with -js"
		say nats "reused the server on 127.0.0.1:$NATS_PORT (JetStream on)"
		return
	fi
	command -v nats-server >/dev/null || [ -x /usr/sbin/nats-server ] || install nats-server
	local bin
	bin=$(command -v nats-server || echo /usr/sbin/nats-server)
	mkdir -p "$STATE_DIR/nats"
	nohup "$bin" -a 127.0.0.1 -p "$NATS_PORT" -js -sd "$(cd "$STATE_DIR" && pwd)/nats" >"$STATE_DIR/nats.log" 2>&1 &
	echo $! >"$STATE_DIR/nats.pid"
	record nats
	wait_port "$NATS_PORT" 30 nats-server
	jetstream_on "$NATS_PORT" || die "nats-server started on 127.0.0.1:$NATS_PORT but reports no JetStream (see $STATE_DIR/nats.log)"
	say nats "started nats-server with JetStream on 127.0.0.1:$NATS_PORT (data in $STATE_DIR/nats)"
}

# up_nats_current runs a current nats-server on NATS_CURRENT_PORT beside an
# older one on NATS_PORT (JetStream's pinned priority groups, for one, need
# 2.11): the version go.mod requires, built from the Go module into the
# cache directory the tests' private servers use (internal/testing/servers),
# with a data directory of its own.
up_nats_current() {
	local sys want have cache bin
	sys=$(nats_version "$NATS_PORT")
	if [ -n "$sys" ] && ! version_below "$sys" "$NATS_CURRENT_BELOW"; then
		say nats-current "not needed: the server on 127.0.0.1:$NATS_PORT is $sys, not older than $NATS_CURRENT_BELOW"
		return
	fi
	command -v go >/dev/null || die "the go command is needed to build a current nats-server (the one on 127.0.0.1:$NATS_PORT is ${sys:-not answering})"
	want=$(go list -m -f '{{.Version}}' "$NATS_MODULE") || die "go list -m $NATS_MODULE failed: run make up from the millrace checkout"
	if port_open "$NATS_CURRENT_PORT"; then
		have=$(nats_version "$NATS_CURRENT_PORT")
		if [ "v$have" != "$want" ] || ! jetstream_on "$NATS_CURRENT_PORT"; then die "127.0.0.1:$NATS_CURRENT_PORT answers as nats-server ${have:-of no version} (JetStream or not), not $want with JetStream: stop it, or set MILLRACE_STACK_NATS_CURRENT_PORT"; fi
		say nats-current "reused nats-server $have on 127.0.0.1:$NATS_CURRENT_PORT (JetStream on)"
		return
	fi
	cache=${XDG_CACHE_HOME:-$HOME/.cache}
	if macos; then cache=$HOME/Library/Caches; fi
	bin="$cache/millrace/nats-server/$want-$(go env GOOS)-$(go env GOARCH)/nats-server"
	if [ "$("$bin" --version 2>/dev/null)" != "nats-server: $want" ]; then
		say nats-current "building nats-server $want from the Go module ($NATS_MODULE@$want) into ${bin%/*}"
		mkdir -p "${bin%/*}"
		go build -o "$bin.tmp$$" "$NATS_MODULE" || die "go build $NATS_MODULE failed"
		mv "$bin.tmp$$" "$bin"
	fi
	mkdir -p "$STATE_DIR/nats-current"
	nohup "$bin" -a 127.0.0.1 -p "$NATS_CURRENT_PORT" -js -sd "$(cd "$STATE_DIR" && pwd)/nats-current" >"$STATE_DIR/nats-current.log" 2>&1 &
	echo $! >"$STATE_DIR/nats-current.pid"
	record nats-current
	wait_port "$NATS_CURRENT_PORT" 30 nats-server
	jetstream_on "$NATS_CURRENT_PORT" || die "nats-server started on 127.0.0.1:$NATS_CURRENT_PORT but reports no JetStream (see $STATE_DIR/nats-current.log)"
	say nats-current "started nats-server $want with JetStream on 127.0.0.1:$NATS_CURRENT_PORT (data in $STATE_DIR/nats-current), as the one on 127.0.0.1:$NATS_PORT is ${sys:-not answering}, older than $NATS_CURRENT_BELOW; NATS_CURRENT_URL=nats://127.0.0.1:$NATS_CURRENT_PORT points tests at it"
}

# pgbouncer_bin prints the pgbouncer binary: on PATH, else Debian's (a
# user's PATH on Debian has no /usr/sbin).
pgbouncer_bin() {
	command -v pgbouncer && return
	[ -x "$PGBOUNCER" ] && echo "$PGBOUNCER"
}

# install_no_start installs $1 with apt-get and lets no service start
# meanwhile: a Debian package's maintainer scripts start its service through
# invoke-rc.d or deb-systemd-invoke, which ask policy-rc.d first and start
# nothing when it exits 101. A policy-rc.d that refuses $1 already is left
# alone; another is set aside during the install and put back after.
install_no_start() {
	local rc=0
	if [ -e "$POLICY_RC_D" ]; then
		"$POLICY_RC_D" "$1" start >/dev/null 2>&1 || rc=$?
		if [ "$rc" = 101 ]; then install "$1"; return; fi
		POLICY_SAVED="$POLICY_RC_D.make-up-saved"
		as_root mv "$POLICY_RC_D" "$POLICY_SAVED"
	fi
	# An interrupted install must not leave every service refused.
	trap restore_policy EXIT
	trap 'exit 130' INT TERM
	as_root bash -c 'printf "#!/bin/sh\n# make up: no service starts while it installs packages\nexit 101\n" >"$1" && chmod 755 "$1"' _ "$POLICY_RC_D"
	install "$1"
	restore_policy
	trap - EXIT INT TERM
}

# restore_policy removes the policy-rc.d install_no_start wrote and puts
# back the one it set aside, if any.
restore_policy() {
	as_root rm -f "$POLICY_RC_D"
	if [ -n "$POLICY_SAVED" ]; then as_root mv "$POLICY_SAVED" "$POLICY_RC_D"; fi
	POLICY_SAVED=""
}

# Tests start private PgBouncers of their own (internal/testing/servers), so `up`
# installs the binary only. Debian's package would also start a
# system-wide pgbouncer on port 6432 and enable it at boot; Homebrew's
# starts nothing unless asked (brew services).
up_pgbouncer() {
	local bin
	if bin=$(pgbouncer_bin); then say pgbouncer "found $bin"; return; fi
	if macos; then
		install pgbouncer
		say pgbouncer "installed $(command -v pgbouncer)"
		return
	fi
	install_no_start pgbouncer
	as_root update-rc.d pgbouncer disable >/dev/null
	bin=$(pgbouncer_bin) || die "pgbouncer was installed but is neither on PATH nor $PGBOUNCER"
	say pgbouncer "installed $bin ($("$bin" --version | head -n1)); its system service neither started nor enabled"
}

# The console's browser tests (ops/console) drive chromium headless; they
# fail, naming this target, when it is missing.
up_chromium() {
	local b
	for b in chromium chromium-browser google-chrome google-chrome-stable; do
		if command -v "$b" >/dev/null; then say chromium "found $(command -v "$b")"; return; fi
	done
	for b in /Applications/Chromium.app/Contents/MacOS/Chromium "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome"; do
		if [ -x "$b" ]; then say chromium "found $b"; return; fi
	done
	install chromium
	if macos; then say chromium "installed /Applications/Chromium.app"; return; fi
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
		"brew "*)
			brew services stop "${line#brew }" >/dev/null && say "${line#brew }" "stopped" ;;
		nats)
			if [ -f "$STATE_DIR/nats.pid" ]; then kill "$(cat "$STATE_DIR/nats.pid")" 2>/dev/null || true; rm -f "$STATE_DIR/nats.pid"; fi
			say nats "stopped" ;;
		nats-current)
			if [ -f "$STATE_DIR/nats-current.pid" ]; then kill "$(cat "$STATE_DIR/nats-current.pid")" 2>/dev/null || true; rm -f "$STATE_DIR/nats-current.pid"; fi
			say nats-current "stopped" ;;
		esac
	done <"$STARTED"
	: >"$STARTED"
	say stack "left running whatever make up did not start"
}

status() {
	local p
	for p in postgresql:$PG_PORT rabbitmq:$AMQP_PORT nats:$NATS_PORT; do
		if port_open "${p#*:}"; then say "${p%:*}" "up on 127.0.0.1:${p#*:}"; else say "${p%:*}" "down"; fi
	done
	local v
	v=$(nats_version "$NATS_PORT")
	if port_open "$NATS_CURRENT_PORT"; then
		say nats-current "up on 127.0.0.1:$NATS_CURRENT_PORT (nats-server $(nats_version "$NATS_CURRENT_PORT"))"
	elif [ -n "$v" ] && ! version_below "$v" "$NATS_CURRENT_BELOW"; then
		say nats-current "not needed (nats-server $v on 127.0.0.1:$NATS_PORT)"
	else
		say nats-current "down (make up starts it: nats-server ${v:-absent} on 127.0.0.1:$NATS_PORT is older than $NATS_CURRENT_BELOW)"
	fi
	if pgbouncer_bin >/dev/null; then say pgbouncer "installed"; else say pgbouncer "missing (make up installs it)"; fi
	if command -v chromium >/dev/null || [ -x /Applications/Chromium.app/Contents/MacOS/Chromium ]; then say chromium "installed"; else say chromium "missing (make up installs it)"; fi
}

case "${1:-}" in
up)
	shift
	[ $# -gt 0 ] || set -- postgres rabbitmq nats nats-current pgbouncer chromium
	for svc in "$@"; do
		case "$svc" in
		postgres) up_postgres; wal_advice ;;
		rabbitmq) up_rabbitmq ;;
		nats) up_nats ;;
		nats-current) up_nats_current ;;
		pgbouncer) up_pgbouncer ;;
		chromium) up_chromium ;;
		*) die "unknown service $svc (postgres, rabbitmq, nats, nats-current, pgbouncer, chromium)" ;;
		esac
	done
	;;
down) down ;;
status) status ;;
*) die "usage: stack.sh up|down|status" ;;
esac
