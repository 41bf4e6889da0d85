package bus

// TypedHandler exposes the HandlerFunc HandleTypes registers, for tests
// that drive it through ConsumerChain.
func TypedHandler(b *Bus, name string, routes []Route, opts ...HandleOption) (string, HandlerFunc, error) {
	return b.typedHandler(name, routes, opts)
}
