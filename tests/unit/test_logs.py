import io
import threading

from orchestrator.transport.logs import Multiplexer, missing_output


def test_lines_prefixed_whole_and_files_complete(tmp_path):
    out = io.BytesIO()
    mux = Multiplexer(tmp_path, out=out, colour=False)
    a, b = mux.sink("node1", 0, 8), mux.sink("node2", 1, 8)
    a.feed(b"hel")
    b.feed(b"one\ntw")
    a.feed(b"lo\nwor")
    b.feed(b"o\n")
    a.feed(b"ld")
    a.close()
    b.close()
    assert out.getvalue().decode().splitlines() == [
        "node2 r1 | one",
        "node1 r0 | hello",
        "node2 r1 | two",
        "node1 r0 | world",
    ]
    assert (tmp_path / "node1.log").read_bytes() == b"hello\nworld"
    assert (tmp_path / "node2.log").read_bytes() == b"one\ntwo\n"
    assert a.last_lines() == "hello\nworld"


def test_colour_prefix_and_concurrent_writers_keep_order(tmp_path):
    out = io.BytesIO()
    mux = Multiplexer(tmp_path, out=out, colour=True)
    sinks = [mux.sink(f"h{i}", i) for i in range(4)]

    def writer(i):
        for n in range(2000):
            sinks[i].feed(f"{n}\n".encode())

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = out.getvalue().decode().splitlines()
    assert len(lines) == 8000
    for i in range(4):
        mine = [line for line in lines if line.startswith(f"\x1b[{(36, 33, 35, 32)[i]}mh{i} r{i} |")]
        assert [int(line.rsplit(" ", 1)[1]) for line in mine] == list(range(2000))


LOG = b"".join(b"step %d loss 1.0\n" % i for i in range(5000))


def test_missing_output_from_the_tail():
    tail = LOG[-20000:]  # `tail -c 20000`: it may begin in the middle of a line
    got = LOG[:-3000]  # the follow stopped 3000 bytes short
    assert missing_output(len(got), got[-4096:], tail, 20000) == LOG[-3000:]
    assert missing_output(len(LOG), LOG[-4096:], tail, 20000) == b""  # nothing missed
    short = LOG[:500]  # a short log: the tail is the whole log
    assert missing_output(200, short[:200][-4096:], short, 20000) == short[200:]


def test_missing_output_gives_up_when_the_tail_cannot_tell():
    tail = LOG[-20000:]
    assert missing_output(100, LOG[:100], tail, 20000) is None  # stopped before the tail begins
    repeated = b"same line\n" * 2000
    assert missing_output(500, repeated[:500], repeated[-10000:], 10000) is None  # ambiguous


def test_terminal_gets_no_control_characters_but_the_file_keeps_them(tmp_path):
    import io

    out = io.BytesIO()
    mux = Multiplexer(tmp_path, out=out, colour=False)
    sink = mux.sink("h", 0)
    raw = b"a\x1b[2Jb\x1b]0;title\x07c\rd\x08e\xc2\x9b31mf\tg \xc3\xa9\n"
    sink.feed(raw)
    sink.close()
    assert out.getvalue() == "h r0 | a[2Jb]0;titlecde31mf\tg \u00e9\n".encode()
    assert (tmp_path / "h.log").read_bytes() == raw
