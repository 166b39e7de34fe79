#!/usr/bin/env python3
"""Writes the golden vectors in this directory with Python's own Jupyter implementation.

The vectors are committed, so `make test` needs no Python. To regenerate them (and the
fuzz seed corpora under protocol/fuzz/seeds/), run `make golden`, or by hand:

    python3 -m venv /tmp/golden-venv
    /tmp/golden-venv/bin/pip install jupyter_client jupyter_server orjson
    /tmp/golden-venv/bin/python protocol/tests/golden/generate.py

Everything is fixed (key, msg_ids, sessions, dates), so running it twice gives the same
files; `git diff` after a run shows what a new jupyter_client or jupyter_server changed.

What is made, and by which function:
- wire.json: `Session.serialize` / `Session.sign` frames, each checked with
  `Session.deserialize`; tampered, wrong-key and unsigned frames that `Session.deserialize`
  refuses; bare `Session.sign` results for odd keys and non-JSON parts.
- websocket.json: what jupyter_server sends to a WebSocket client for those frames:
  `serialize_msg_to_ws_v1` (the v1 subprotocol) and `_reserialize_reply` (legacy: JSON
  text, or `serialize_binary_message` when there are buffers).
- connection.json: files written by `jupyter_client.connect.write_connection_file`, with
  the endpoints jupyter_client's own `_make_url` derives from them.

Bytes are stored as hex. A vector marked `"byte_identical": true` was packed with
compact JSON in kernelgate's header field order, so kernelgate's encoder must reproduce
every frame exactly; the others use jupyter_client's real packers and header order and are
compared by value (see protocol/tests/golden.rs).
"""

import datetime
import json
import pathlib
import shutil
import tempfile
import types

import jupyter_client
import jupyter_server
from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.connect import write_connection_file
from jupyter_client.jsonutil import json_default
from jupyter_client.session import Session, json_packer
from jupyter_server.services.kernels.connection.base import (
    deserialize_binary_message,
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)
from jupyter_server.services.kernels.connection.channels import (
    ZMQChannelsWebsocketConnection,
)

try:
    from jupyter_client.session import orjson_packer, has_orjson
except ImportError:  # older jupyter_client
    has_orjson = False

HERE = pathlib.Path(__file__).resolve().parent
SEEDS = HERE.parent.parent / "fuzz" / "seeds"

KEY = b"5f0c2a3e-9b1d-4c7e-8f60-golden-key"
OTHER_KEY = b"not-the-kernel-key"
SESSION = "b1946ac9-2f7e-4d9c-8b51-golden"
DATE = datetime.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=datetime.timezone.utc)
LATER = datetime.datetime(2026, 1, 2, 3, 4, 6, tzinfo=datetime.timezone.utc)
IDENTITIES = [b"\x00k\x8b\x45\x67", b"client-1"]


def compact_packer(obj):
    """JSON as serde_json writes it: no spaces, non-ASCII kept, dict order kept."""
    return json.dumps(
        obj, default=json_default, ensure_ascii=False, allow_nan=False, separators=(",", ":")
    ).encode("utf8")


PACKERS = {"json": json_packer, "compact": compact_packer}
if has_orjson:
    PACKERS["orjson"] = orjson_packer


def session(key=KEY, packer="json"):
    s = Session(key=key, session=SESSION, username="golden")
    s.pack = PACKERS[packer]
    return s


def jupyter_header(msg_id, msg_type, date=DATE, username="golden", **extra):
    """A header in jupyter_client's own key order (`session.msg_header`)."""
    h = {"msg_id": msg_id, "msg_type": msg_type, "username": username, "session": SESSION,
         "date": date, "version": "5.3"}
    h.update(extra)
    return h


def our_header(msg_id, msg_type, date=DATE, username="golden", **extra):
    """A header in the order kernelgate serializes its fields, extras last."""
    h = {"msg_id": msg_id, "session": SESSION, "username": username, "date": date,
         "msg_type": msg_type, "version": "5.3"}
    h.update(extra)
    return h


def as_json(value):
    """The JSON value a Python dict stands for (datetimes written as jupyter_client does)."""
    return json.loads(json.dumps(value, default=json_default))


def expected(spec):
    """The values a decoder must produce for a message spec."""
    return {
        "header": as_json(spec["header"]),
        "parent_header": as_json(spec["parent"]) if spec["parent"] else None,
        "metadata": as_json(spec["metadata"]),
        "content": as_json(spec["content"]),
        "buffers": [b.hex() for b in spec["buffers"]],
    }


EXECUTE = jupyter_header("5e2a1c1e-0001-golden", "execute_request")
EXECUTE_CONTENT = {"code": "print('héllo ✓')\n", "silent": False, "store_history": True,
                   "user_expressions": {}, "allow_stdin": True, "stop_on_error": True}

MESSAGES = [
    # name, packer, key, header, parent, metadata, content, buffers, identities, byte_identical
    dict(name="execute_request", packer="json", header=EXECUTE, parent=None, metadata={},
         content=EXECUTE_CONTENT, buffers=[], identities=IDENTITIES),
    dict(name="stream_with_parent", packer="json",
         header=jupyter_header("5e2a1c1e-0002-golden", "stream", date=LATER),
         parent=EXECUTE, metadata={"x": [1, 2.5, None, "é"]},
         content={"name": "stdout", "text": "tab\there\nbell\x07 snow☃ \U0001F600 \"q\" \\"},
         buffers=[], identities=[]),
    dict(name="comm_msg_with_buffers_and_extra_header_fields", packer="json",
         header=jupyter_header("5e2a1c1e-0003-golden", "comm_msg", subshell_id=None,
                               **{"x-vendor": {"k": [1, 2], "s": "ü"}}),
         parent=EXECUTE, metadata={},
         content={"comm_id": "c0ffee", "data": {"method": "update", "buffer_paths": [["a"], ["b"]]}},
         buffers=[b"\x00\xff\x10binary", b"", bytes(range(256))], identities=[b"router-peer"]),
    dict(name="unsigned_empty_key", packer="json", key=b"",
         header=jupyter_header("5e2a1c1e-0004-golden", "kernel_info_request"), parent=None,
         metadata={}, content={}, buffers=[], identities=[]),
    dict(name="compact_our_order", packer="compact", byte_identical=True,
         header=our_header("5e2a1c1e-0005-golden", "display_data", username="üser\x01",
                           subshell_id="sub-1"),
         parent=our_header("5e2a1c1e-0001-golden", "execute_request"),
         metadata={"isolated": True},
         content={"data": {"text/plain": "'ok' ✓\u2028"}, "metadata": {}, "transient": {}},
         buffers=[b"\x01\x02"], identities=[b"id"]),
    dict(name="compact_our_order_no_parent_no_buffers", packer="compact", byte_identical=True,
         header=our_header("5e2a1c1e-0006-golden", "status"), parent=None, metadata={},
         content={"execution_state": "idle"}, buffers=[], identities=[]),
]
if has_orjson:
    MESSAGES += [
        dict(name="orjson_jupyter_order", packer="orjson",
             header=jupyter_header("5e2a1c1e-0007-golden", "execute_reply"), parent=EXECUTE,
             metadata={"started": DATE},
             content={"status": "ok", "execution_count": 3, "user_expressions": {}},
             buffers=[], identities=[]),
        dict(name="orjson_our_order", packer="orjson", byte_identical=True,
             header=our_header("5e2a1c1e-0008-golden", "stream", username="ünï☃\x1f\n"),
             parent=our_header("5e2a1c1e-0001-golden", "execute_request"),
             metadata={}, content={"name": "stderr", "text": "a\tb\x00c\u007f"},
             buffers=[b"buf"], identities=[]),
    ]


def serialize(spec):
    key = spec.get("key", KEY)
    s = session(key, spec["packer"])
    msg = s.msg(spec["header"]["msg_type"], content=spec["content"], parent=spec["parent"],
                header=spec["header"], metadata=spec["metadata"])
    frames = s.serialize(msg, ident=list(spec["identities"])) + list(spec["buffers"])
    return s, frames


def wire_vectors():
    vectors, refused = [], []
    for spec in MESSAGES:
        key = spec.get("key", KEY)
        s, frames = serialize(spec)
        idents, rest = s.feed_identities(frames)
        assert idents == spec["identities"]
        # Session.deserialize verifies the signature (each check on a fresh Session: it
        # refuses a signature it has seen before).
        back = session(key, spec["packer"]).deserialize(rest)
        assert as_json(back["header"]) == as_json(spec["header"]), spec["name"]
        assert back["content"] == spec["content"]
        assert [bytes(b) for b in back["buffers"]] == spec["buffers"]
        vectors.append({
            "name": spec["name"],
            "packer": spec["packer"],
            "key": key.decode(),
            "byte_identical": spec.get("byte_identical", False),
            "frames": [f.hex() for f in frames],
            "identities": [i.hex() for i in spec["identities"]],
            "signature": rest[0].decode(),
            "expect": expected(spec),
        })

    # Frames that Session.deserialize refuses, with the reason it gives.
    _, good = serialize(MESSAGES[0])
    delim = good.index(b"<IDS|MSG>")
    sig, content = delim + 1, delim + 5
    tampered = list(good)
    tampered[content] = tampered[content].replace(b"print", b"prinT")
    _, wrong_key = serialize(dict(MESSAGES[0], key=OTHER_KEY))
    _, unsigned = serialize(dict(MESSAGES[0], key=b""))
    bad_hex = list(good)
    bad_hex[sig] = b"zz" + good[sig][2:]
    upper = list(good)
    upper[sig] = good[sig].upper()
    assert upper[sig] != good[sig]
    for name, frames, error in [
        ("tampered_content", tampered, "SignatureMismatch"),
        ("wrong_key", wrong_key, "SignatureMismatch"),
        ("unsigned_to_keyed_session", unsigned, "Unsigned"),
        ("signature_not_hex", bad_hex, "SignatureMismatch"),
        ("signature_uppercase_hex", upper, "SignatureMismatch"),
    ]:
        try:
            session().deserialize(session().feed_identities(frames)[1])
        except ValueError as e:
            reason = str(e)
        else:
            raise AssertionError(f"jupyter_client accepted {name}")
        refused.append({"name": name, "key": KEY.decode(), "frames": [f.hex() for f in frames],
                        "error": error, "jupyter_client_error": reason.split(":")[0]})

    # Session.sign on its own: keys longer than the HMAC block, non-ASCII keys, parts that
    # are not JSON at all.
    signs = []
    for key, parts in [
        (KEY, [b"{}", b"{}", b"{}", b"{}"]),
        (b"k", [b"", b"", b"", b""]),
        ("ключ-🔑".encode(), [b'{"a": 1}', b"{}", b"\x00\xff", "é".encode()]),
        (b"x" * 200, [b"header", b"parent", b"metadata", b"content"]),
        (bytes(range(1, 65)), [b"[1,2]", b"null", b"{}", b'"s"']),
    ]:
        signs.append({"key": key.hex(), "parts": [p.hex() for p in parts],
                      "signature": session(key).sign(parts).decode()})
    return vectors, refused, signs


def websocket_vectors():
    # jupyter_server's legacy path is a method; it only uses `self.session`.
    def legacy(frames, channel, key):
        fake = types.SimpleNamespace(session=session(key))
        return ZMQChannelsWebsocketConnection._reserialize_reply(fake, list(frames), channel)

    out = []
    channels = {"execute_request": "shell", "unsigned_empty_key": "shell"}
    for spec in MESSAGES:
        key = spec.get("key", KEY)
        s, frames = serialize(spec)
        _, rest = s.feed_identities(frames)
        channel = channels.get(spec["name"], "iopub")
        # What ZMQChannelsWebsocketConnection sends: v1 gets the frames after the signature.
        v1 = serialize_msg_to_ws_v1(rest[1:], channel)
        got_channel, parts = deserialize_msg_from_ws_v1(v1)
        assert got_channel == channel and parts[:4] == rest[1:5]
        legacy_msg = legacy(frames, channel, key)
        if isinstance(legacy_msg, bytes):
            assert deserialize_binary_message(legacy_msg)["buffers"] == spec["buffers"]
            legacy_kind, legacy_hex = "binary", legacy_msg.hex()
        else:
            legacy_kind, legacy_hex = "text", legacy_msg.encode().hex()
        out.append({
            "name": spec["name"],
            "channel": channel,
            "byte_identical": spec.get("byte_identical", False),
            "v1": v1.hex(),
            "legacy_kind": legacy_kind,
            "legacy": legacy_hex,
            "expect": expected(spec),
        })
    return out


def connection_vectors():
    out = []
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kg-golden-"))
    try:
        for name, kwargs in [
            ("tcp", dict(ip="127.0.0.1", transport="tcp", shell_port=53794, iopub_port=53795,
                         stdin_port=53796, control_port=53797, hb_port=53798, key=KEY,
                         kernel_name="python3")),
            ("tcp_with_extra_fields", dict(ip="0.0.0.0", transport="tcp", shell_port=1,
                                           iopub_port=2, stdin_port=3, control_port=4,
                                           hb_port=65535, key=KEY, kernel_name="",
                                           jupyter_session="/home/u/nb.ipynb")),
            ("ipc", dict(ip="/run/kernelgate/k-0001/kernel", transport="ipc", shell_port=1,
                         iopub_port=2, stdin_port=3, control_port=4, hb_port=5, key=KEY,
                         kernel_name="python3")),
            ("ipc_unsigned", dict(ip="/tmp/kernel", transport="ipc", shell_port=10,
                                  iopub_port=11, stdin_port=12, control_port=13, hb_port=14,
                                  key=b"", kernel_name="python3")),
        ]:
            fname, cfg = write_connection_file(str(tmp / f"{name}.json"), **kwargs)
            text = pathlib.Path(fname).read_text()
            client = BlockingKernelClient(connection_file=fname)
            client.load_connection_file()
            out.append({
                "name": name,
                "file": text,
                "expect": json.loads(text),
                "endpoints": {c: client._make_url(c)
                              for c in ["shell", "iopub", "stdin", "control", "hb"]},
            })
    finally:
        shutil.rmtree(tmp)
    return out


SEPARATOR = b"\n--frame--\n"


def write_seeds(wire, refused, ws, conn):
    """Seed corpora for the fuzz targets (formats in protocol/fuzz/fuzz_targets/*.rs)."""
    if SEEDS.exists():
        shutil.rmtree(SEEDS)
    def put(target, name, data):
        d = SEEDS / target
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    for v in wire + refused:
        # First byte: 0 = verify with the golden key, 1 = unsigned (reach the JSON parsing).
        frames = [bytes.fromhex(f) for f in v["frames"]]
        for selector in (0, 1):
            put("wire_decode", f"{v['name']}-{selector}", bytes([selector]) + SEPARATOR.join(frames))
    for v in ws:
        put("ws_v1", v["name"], bytes.fromhex(v["v1"]))
        target = "ws_legacy_binary" if v["legacy_kind"] == "binary" else "ws_legacy_text"
        put(target, v["name"], bytes.fromhex(v["legacy"]))
    for v in conn:
        put("connection_file", v["name"], v["file"].encode())


def dump(name, value):
    (HERE / name).write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n")


def main():
    wire, refused, signs = wire_vectors()
    ws = websocket_vectors()
    conn = connection_vectors()
    versions = {"jupyter_client": jupyter_client.__version__,
                "jupyter_server": jupyter_server.__version__, "orjson": has_orjson}
    dump("wire.json", {"generated_by": versions, "messages": wire, "refused": refused,
                       "signatures": signs})
    dump("websocket.json", {"generated_by": versions, "messages": ws})
    dump("connection.json", {"generated_by": versions, "files": conn})
    write_seeds(wire, refused, ws, conn)


if __name__ == "__main__":
    main()
