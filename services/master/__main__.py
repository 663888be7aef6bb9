from specpilot.services.master.main import main

main()
