from kvctl.cli import main

main()
