// Command millrace operates a millrace installation from the same config.yaml
// the services use. It is flags and formatting over package ops, the
// operations API a service or an admin tool can call from Go.
//
//	millrace [--config config.yaml] migrate
//	millrace [--config config.yaml] outbox status
//	millrace [--config config.yaml] relay [--metrics ADDR]
//	millrace [--config config.yaml] dlq list [filters] [--limit N]
//	millrace [--config config.yaml] dlq groups [filters]
//	millrace [--config config.yaml] dlq show [--hex] ID
//	millrace [--config config.yaml] dlq replay [--dry-run] [--force] (ID... | filters | --all)
//	millrace [--config config.yaml] dlq purge [--dry-run] [--yes] (ID... | filters | --all)
//	millrace [--config config.yaml] quarantine list [filters] [--limit N]
//	millrace [--config config.yaml] quarantine show [--hex] ID
//	millrace [--config config.yaml] quarantine replay [--dry-run] [--force] (ID... | filters | --all)
//	millrace [--config config.yaml] quarantine purge [--dry-run] [--yes] (ID... | filters | --all)
//	millrace [--config config.yaml] inbox purge --older-than DURATION [--group G] [--batch N] [--dry-run]
//	millrace [--config config.yaml] grants --role NAME
//	millrace [--config config.yaml] ui [--listen ADDR] [--read-only] [--token-file FILE | --user U]
//	millrace version
//
// Every command has --help (on stdout) and --json (its output as one JSON
// document with stable field names, described in this directory's
// README.md). Flags, the global --config and --json included, may come
// before or after the command and its positional arguments. Exit codes: 0
// success, 1 the command failed, 2 bad usage or configuration; errors go to
// stderr as "millrace <command>: <message>", usage errors followed by the
// usage. Commands that only need the database ignore problems of the broker
// section. No password of a configured URL is ever printed.
package main
