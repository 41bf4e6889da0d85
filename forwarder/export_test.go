package forwarder

// Test hooks: these let tests stop a relay at an exact point of a batch.

func SetBeforePublish(f *Forwarder, hook func(batch int)) { f.beforePublish = hook }

func SetAfterPublish(f *Forwarder, hook func(batch int)) { f.afterPublish = hook }

func SetAfterScheduledMove(f *Forwarder, hook func(moved int)) { f.afterScheduledMove = hook }
