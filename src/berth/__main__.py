from berth.cli.main import main

main()
