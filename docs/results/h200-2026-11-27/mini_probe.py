import ctypes, sys
if sys.argv[2] == "torch":
    import torch
lib = ctypes.CDLL(sys.argv[1])
buf = ctypes.create_string_buffer(64)
lib.format_int(42, buf, 64)
print(sys.argv[1:], buf.value)
