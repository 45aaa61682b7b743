from .local import main

main()
