// Package confload decodes millrace's YAML configuration into Go structs while
// collecting every problem with the YAML path it belongs to.
//
// It exists because yaml.v3's KnownFields reports only the first unknown key,
// by line number, and never the dotted path users see in config.yaml.
package confload
