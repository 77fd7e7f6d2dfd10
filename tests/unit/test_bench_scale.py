

def test_requests_start_with_the_load_not_with_the_fill():
    """A long fill must not leave a backlog of requests that all go out at the first step."""
    shards = [FakeShard() for _ in range(2)]
    clock = Clock()
    rates = scale.LoadRates(events_per_s=0, requests_per_s=1.0, query_keys=10, flush_s=2.0, held=64)
    generator = scale.LoadGenerator(NAMESPACE, "node0", [1, 2], shards, rates, clock=clock)
    generator.fill(clock())
    clock.now += 30.0  # the fill's drain took long
    drain(generator, shards, clock)
    generator.start(clock())
    clock.now += 1.0
    generator.step(clock())
    assert generator.offered["requests"] == 2
