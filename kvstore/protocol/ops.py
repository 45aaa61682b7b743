"""Operation names of the data plane (worker -> server requests and replies)."""

CONFIGURE = "configure"          # {mode: "sync"|"async"|"ssp", num_workers, staleness (ssp), ...}
INIT = "init"                    # chunks + one buffer each: initial values
PUSH = "push"                    # chunks + one buffer each: gradients ({norms: true}: layer-wise,
                                 # replied to with each chunk's terms once its round is complete)
PULL = "pull"                    # chunks; reply carries one buffer each
PUSHPULL = "pushpull"            # push, then reply with the values after the round
SET_OPTIMIZER = "set_optimizer"  # {optimizer: {name, params, lr_scheduler}}
GET_STATES = "get_states"        # reply: optimizer state of every chunk
SET_STATES = "set_states"        # optimizer state of some chunks
APPLY_NORMS = "apply_norms"      # {chunks, sums, rounds, values}: a key's summed terms (norms across servers)
# Checkpoints (kvstore/server/checkpoint.py): a job-wide set in two phases, and the resume
CHECKPOINT = "checkpoint"        # {checkpoint, step, meta}: phase 1, write this server's part
CHECKPOINT_COMMIT = "checkpoint_commit"    # {checkpoint}: phase 2, every part is durable
CHECKPOINT_LIST = "checkpoint_list"        # reply {files: [entry], max_id}: what this server holds
CHECKPOINT_RESTORE = "checkpoint_restore"  # {checkpoint}: resume from that set (--resume)
GET_META = "get_meta"            # reply {meta, resumed, checkpoint, step}: the restored checkpoint
WRITE = "write"                  # chunks, no buffers (shared memory, sync): reply {modes} + one
                                 # buffer per chunk in the server's memory, to copy or add into
WRITTEN = "written"              # {grant: the write's id}: done; replied to as a pushpull
COPY, ADD = "copy", "add"        # a write grant's modes: overwrite the sum (opens the round) or add to it
# Row-sparse keys (kvstore.server.tables): one chunk [key, server] per server, global row ids
INIT_ROWS = "init_rows"          # {chunk, shape, dtype, servers, init: RowInit wire|None} + row ids, rows
PUSH_ROWS = "push_rows"          # {chunk} + row ids (int64, unique, sorted) + their gradient rows
PULL_ROWS = "pull_rows"          # {chunk} + row ids; reply carries their rows
SET_ROWS = "set_rows"            # {chunk} + row ids (int64, unique, sorted) + their new values
# Dynamic rows (kvstore.server.dyntables): ids in [0, 2**63) on server splitmix64(id) % S
INIT_DYN = "init_dyn"            # {chunk, servers, spec: DynamicRows wire}, no buffers
PUSH_DYN = "push_dyn"            # {chunk} + ids (int64, unique, sorted) + their gradient rows
PULL_DYN = "pull_dyn"            # {chunk} + ids; reply carries their rows (initial values for ids with none)
DYN_STATS = "dyn_stats"          # {chunk}; reply {stats: {rows, created, evicted, hits, misses, ...}}
# Replicated servers (kvstore.server.replication): a primary to its backup, server to server
REPLICATE = "replicate"          # {kind: init|rounds, chunks, rounds, updated} + one buffer per chunk: the
                                 # values an init stored, or each applied round's sum (the value without optimizer)

INITS = frozenset({INIT, INIT_ROWS, INIT_DYN})      # requests that create keys
REQUESTS = frozenset({CONFIGURE, INIT, PUSH, PULL, PUSHPULL, SET_OPTIMIZER, GET_STATES, SET_STATES,
                      CHECKPOINT, CHECKPOINT_COMMIT, CHECKPOINT_LIST, CHECKPOINT_RESTORE,
                      GET_META, WRITE, WRITTEN, INIT_ROWS, PUSH_ROWS,
                      PULL_ROWS, SET_ROWS, INIT_DYN, PUSH_DYN, PULL_DYN, DYN_STATS, APPLY_NORMS, REPLICATE})
# requests that contribute to rounds: only members of an elastic job send them
PUSHING = frozenset({PUSH, PUSHPULL, WRITE, WRITTEN, PUSH_ROWS, PUSH_DYN})

# Answered by the server node, not its state machine (kvstore.server.commands):
COMMAND = "command"              # {head, body}: MXNet's _send_command_to_servers; reply {result}
DURABLE = "durable"              # no fields: replied to once what the server applied is on its backups
NODE = frozenset({COMMAND, DURABLE})

# Answered by the server's transport layer, not its state machine:
HELLO = "hello"                  # {nonce} + one shared buffer holding it: probe shared memory
CHANNEL = "channel"              # reply {port, token}: open a data channel (transport.channel)
DEVICE_HELLO = "device_hello"    # {nonce} + one device buffer by reference holding it: probe CUDA IPC
TRANSPORT = frozenset({HELLO, CHANNEL, DEVICE_HELLO})

# the requests whose buffers may be device memory by reference (the cuda_ipc transport)
DEVICE_BUFFERS = frozenset({PUSH, PUSHPULL, DEVICE_HELLO})

OK = "ok"          # reply: success (with buffers for pull, pushpull, get_states)
ERROR = "error"    # reply: {kind, message}
