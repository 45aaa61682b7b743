"""The ops of the messages between the workers of one host group
(kvstore.hostgroup.group; docs/protocol.md, "group" of push and pushpull).

Each message is the data plane's frames (kvstore.protocol.codec) between a member
(DEALER) and its leader (ROUTER), ``id`` being the call's sequence number::

    member -> leader   hello {rank, devices}            once, when the group forms
    leader -> member   welcome {devices}
    member -> leader   sum {id, sig, keys, consumed} + gradients   at each pushpull's start
    leader -> member   result {id} + pulled values      once the servers replied
    leader -> member   error {id, type, message}        the call failed (nothing changed)
    member -> leader   bye {consumed}                   a clean close
"""

HELLO, WELCOME = "hello", "welcome"                 # forming the group
SUM, RESULT, ERROR = "sum", "result", "error"       # one pushpull
BYE = "bye"                                         # a member's clean close
