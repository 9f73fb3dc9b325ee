from leat_server import ServeOptions, default_api_workers


def test_api_workers_default_follows_the_cores():
    assert ServeOptions("default").api_workers is None  # decided when serving, from the machine's cores
    assert [default_api_workers(c) for c in (1, 2, 7, 8, 16, 31, 32, 64, 256)] == [0, 0, 0, 1, 2, 3, 4, 4, 4]
