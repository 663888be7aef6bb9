from services.master.main import main

main()
