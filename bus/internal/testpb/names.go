package testpb

// EventType is OrderPlaced's wire name.
func (*OrderPlaced) EventType() string { return "OrderPlaced" }

// Aggregate is the order the event is about.
func (m *OrderPlaced) Aggregate() (aggregateType, aggregateID string) {
	return "order", m.GetOrderId()
}
