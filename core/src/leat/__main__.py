from leat.cli import main

main()
