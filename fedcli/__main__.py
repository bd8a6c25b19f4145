from fedcli.cli.main import main

main()
