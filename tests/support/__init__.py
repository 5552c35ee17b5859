"""What the tests share: deadline waits, reference runs, broker cores, cluster harnesses,
tiny models. Each helper is written once, here."""
