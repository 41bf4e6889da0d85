// Package testpb holds the protobuf messages the bus package's tests and
// examples publish with the protobuf codec. orders.pb.go is generated from
// orders.proto by protoc with protoc-gen-go (go generate).
package testpb

//go:generate protoc --go_out=. --go_opt=paths=source_relative orders.proto
